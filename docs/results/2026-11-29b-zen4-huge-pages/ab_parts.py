"""Decode at a 976-token context, two engines of one model in one process alternated round by
round; LAYOUTS=joined,blocks (load order) picks each one's layout for a fused linear of mixed
code widths: one layout at the widest width (before 1b9237c) or row blocks. The quantized
cache is neither read nor written (it would hand the second engine the first's layout)."""
import os, statistics, sys, time
sys.path.insert(0, os.environ.get("REPO", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import engine.loading.gguf as g
import engine.loading.quantized_cache as qc
from pathlib import Path
from engine import EngineConfig, LLMEngine, SamplingParams
qc.write = lambda model, path: None
qc.cache_file = lambda *a: Path("/nonexistent/none.safetensors")
M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
real = g.row_blocks
def joined_blocks(parts):
    return [parts[0] if len(parts) == 1 else g.GroupCodes.cat(parts)]
engines = []
for i, layout in enumerate(os.environ.get("LAYOUTS", "joined,blocks").split(",")):
    g.row_blocks = joined_blocks if layout == "joined" else real
    e = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
    from tools.bench_decode_step import weight_bytes_per_step
    print(f"engine {i} {layout}: {weight_bytes_per_step(e)/1e6:.1f} MB", flush=True)
    engines.append((e, f"{i}-{layout}"))
V = engines[0][0].vocab_size
prompt = [(i * 7919) % (V - 100) + 100 for i in range(976)]
res = {name: [] for _, name in engines}
def run(eng, name, r):
    eng.add_request(f"r{r}", prompt, SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))
    eng.step(); eng.step()
    steps = []
    while eng.has_unfinished_requests():
        t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
    res[name].append(statistics.median(steps) * 1e3)
(a, an), (b, bn) = engines
for r in range(int(os.environ.get("ROUNDS", 10))):
    for eng, name in [(a, an), (b, bn)][:: 1 if r % 2 else -1]:
        run(eng, name, r)
    print(f"round {r}: {an} {res[an][-1]:.2f} {bn} {res[bn][-1]:.2f} ratio {res[bn][-1]/res[an][-1]:.3f}", flush=True)
ratios = [y / x for x, y in zip(res[an], res[bn])]
print(f"median {an} {statistics.median(res[an]):.2f}, {bn} {statistics.median(res[bn]):.2f}, median ratio {bn}/{an} {statistics.median(ratios):.3f}")
