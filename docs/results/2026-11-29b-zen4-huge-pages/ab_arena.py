"""Decode at a 976-token context, two engines of one model in one process alternated round by
round; ARENA=1,0 (load order) says which one keeps its kernel weights on 2 MB pages."""
import os, statistics, sys, time
sys.path.insert(0, os.environ.get("REPO", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import engine.loading.quantized_cache as qc
import engine.loading.build as b
from engine import EngineConfig, LLMEngine, SamplingParams
M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
engines = []
for i, arena in enumerate(os.environ.get("ARENA", "1,0").split(",")):
    # the build path moves the weights, the cached path reads them into an arena: both off
    b.huge_pages_available = qc.huge_pages_available = (lambda on=arena == "1": on)
    e = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
    engines.append((e, f"{i}-arena{arena}"))
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
(a, an), (bb, bn) = engines
for r in range(int(os.environ.get("ROUNDS", 10))):
    for eng, name in [(a, an), (bb, bn)][:: 1 if r % 2 else -1]:
        run(eng, name, r)
    print(f"round {r}: {an} {res[an][-1]:.2f} {bn} {res[bn][-1]:.2f} ratio {res[bn][-1]/res[an][-1]:.3f}", flush=True)
ratios = [y / x for x, y in zip(res[an], res[bn])]
print(f"median {an} {statistics.median(res[an]):.2f}, {bn} {statistics.median(res[bn]):.2f}, median ratio {bn}/{an} {statistics.median(ratios):.3f}")
