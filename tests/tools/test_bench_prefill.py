"""tools/bench_prefill.py on the tiny Llama: a report per run, each run a prompt of its own."""

from __future__ import annotations

from pathlib import Path

from tools import bench_prefill


def test_the_report_lists_every_run_of_a_distinct_prompt(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    report = bench_prefill.main(
        ["--tokens", "40", "--runs", "3", "--model", str(tiny_llama_path), "--out", str(out)]
    )
    assert len(report["tokens_per_s"]) == 3  # type: ignore[arg-type]
    assert report["median_tokens_per_s"] > 0  # type: ignore[operator]
    assert out.read_text().startswith("{")
    prompts = [bench_prefill.prompt_ids(40, run, 512) for run in range(3)]
    assert len({tuple(p) for p in prompts}) == 3 and all(100 <= i < 512 for p in prompts for i in p)


def test_the_peer_gets_the_same_prompts_uncached_and_its_own_rate_is_reported(
    tmp_path: Path,
) -> None:
    """`--llama-cpp URL`: each run's ids go to `/completion` with the prompt cache off and one
    token out; the report holds the client's rate and the server's `prompt_per_second`."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict[str, object]] = []

    class FakeLlamaCpp(BaseHTTPRequestHandler):
        def _answer(self, payload: dict[str, object]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            assert self.path == "/v1/models"
            self._answer({"data": [{"id": "m", "meta": {"n_vocab": 512}}]})

        def do_POST(self) -> None:
            assert self.path == "/completion"
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._answer({"content": "x", "timings": {"prompt_per_second": 123.4}})

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaCpp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        report = bench_prefill.main(["--tokens", "40", "--runs", "3", "--llama-cpp", url])
    finally:
        server.shutdown()
        server.server_close()
    assert [b["prompt"] for b in bodies] == [bench_prefill.prompt_ids(40, r, 512) for r in range(3)]
    assert all(b["cache_prompt"] is False and b["n_predict"] == 1 for b in bodies)
    assert report["server_prompt_per_second"] == [123.4, 123.4, 123.4]
    assert len(report["tokens_per_s"]) == 3  # type: ignore[arg-type]
