"""The 1B's intent-like step in-process: 944 cached tokens, 77 new ones; median of rounds."""
import os, sys, time, statistics
sys.path.insert(0, "/work/main")
from engine import EngineConfig, LLMEngine, SamplingParams

def main():
    M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
    eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024, speculative="off"))
    V = eng.vocab_size
    prefix = [(i * 7919) % (V - 100) + 100 for i in range(944)]
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eng.add_request("warm", prefix + [5, 6, 7], p)
    while eng.has_unfinished_requests(): eng.step()
    times = []
    for r in range(int(os.environ.get("ROUNDS", 6))):
        suffix = [(i * 31 + r * 977) % (V - 100) + 100 for i in range(77)]
        eng.add_request(f"r{r}", prefix + suffix, p)
        t = time.perf_counter()
        while eng.has_unfinished_requests(): eng.step()
        times.append(time.perf_counter() - t)
    print(os.environ.get("LABEL", ""), "step ms", [round(x * 1e3) for x in times], "median", round(statistics.median(times) * 1e3))

if __name__ == "__main__":
    main()
