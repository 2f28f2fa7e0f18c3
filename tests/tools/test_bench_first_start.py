"""tools/bench_first_start.py on the tiny Llama: two starts a round on an empty cache folder
with the built kernels linked in, each broken down, and what the folder holds after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools import bench_first_start


def test_a_round_is_a_first_and_a_second_start_on_one_new_folder(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    report = bench_first_start.main(
        ["--model", str(tiny_llama_path), "--rounds", "1", "--port", "8131",
         "--kv-cache-memory", "16MiB", "--out", str(out)]
    )  # fmt: skip
    rounds: list[dict[str, Any]] = report["rounds"]  # type: ignore[assignment]
    [one] = rounds
    for start in ("first", "second"):
        assert one[start]["health_200_s"] > 0
        breakdown = one[start]["breakdown_s"]
        assert breakdown["gguf_conversion"] is None  # a folder: nothing to convert
        assert breakdown["imports"] is not None and breakdown["engine_ready"] is not None
    # the first start cached the config and tokenizer there, not in the user's cache; the
    # linked kernels are not counted
    assert {"configs", "tokenizers"} <= set(one["cache_mb"])
    assert "kernels" not in one["cache_mb"]
    assert out.read_text().startswith("{")
