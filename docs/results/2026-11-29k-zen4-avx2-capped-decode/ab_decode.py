"""Decode at a 976-token context: prefixgate's engine step (no drafts) against llama-bench's
tg32 at depth 976, alternated round by round in one window (the engine stays loaded)."""
import json, os, statistics, subprocess, sys, time
sys.path.insert(0, os.environ.get("REPO", "/work/main"))
from engine import EngineConfig, LLMEngine, SamplingParams

def main():
    M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
    BENCH = os.environ.get("BENCH", "/work/peers/llama.cpp-build/bin/llama-bench")
    eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024, speculative="off", dtype=os.environ.get("DTYPE", "auto")))
    print(eng.runner.model.__class__.__name__, os.environ.get("ATEN_CPU_CAPABILITY"), flush=True)
    V = eng.vocab_size
    prompt = [(i * 7919) % (V - 100) + 100 for i in range(976)]
    ours, theirs = [], []
    for r in range(int(os.environ.get("ROUNDS", 8))):
        time.sleep(0.3)
        out = subprocess.run([BENCH, "-m", M, "-p", "0", "-n", "32", "-d", "976", "-t", "2", "-r", "1", "-o", "json"],
                             capture_output=True, text=True, check=True).stdout
        theirs.append(1e3 / json.loads(out)[0]["avg_ts"])
        eng.add_request(f"r{r}", prompt, SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))
        eng.step(); eng.step()
        steps = []
        while eng.has_unfinished_requests():
            t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
        ours.append(statistics.median(steps) * 1e3)
        print(f"round {r}: llama.cpp {theirs[-1]:.1f} ms/token, prefixgate step p50 {ours[-1]:.1f} ms ({len(steps)} steps), ratio {ours[-1]/theirs[-1]:.3f}", flush=True)
    print(f"median: llama.cpp {statistics.median(theirs):.1f}, prefixgate {statistics.median(ours):.1f}, median ratio {statistics.median(o/t for o, t in zip(ours, theirs)):.3f}")

if __name__ == "__main__":
    main()
