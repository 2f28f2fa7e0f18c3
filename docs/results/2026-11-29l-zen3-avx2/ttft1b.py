"""The 1B's intent-like step in-process: 944 cached tokens, 77 new ones; median of rounds.
PROFILE=1 profiles the fourth round (torch.profiler, by op and input shape)."""
import os, sys, time, statistics
sys.path.insert(0, os.getcwd())  # run from the repository root
import torch
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
        prof = os.environ.get("PROFILE") == "1" and r == 3
        if prof:
            ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            ctx.__enter__()
        t = time.perf_counter()
        while eng.has_unfinished_requests(): eng.step()
        times.append(time.perf_counter() - t)
        if prof:
            ctx.__exit__(None, None, None)
            print(ctx.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=14))
    print(os.environ.get("LABEL", ""), "step ms", [round(x * 1e3) for x in times], "median", round(statistics.median(times) * 1e3))

if __name__ == "__main__":
    main()
