"""SmolLM2 1000-token uncached prefill in one step, in-process; PROFILE=1 profiles one run."""
import os, sys, time, statistics
sys.path.insert(0, ".")  # run from the repository root
import torch
from engine import EngineConfig, LLMEngine, SamplingParams

def main():
    N = int(os.environ.get("TOKENS", 1000))
    eng = LLMEngine(EngineConfig(max_model_len=N + 8, max_num_batched_tokens=N, enable_prefix_cache=False, speculative="off"))
    V = eng.vocab_size
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(int(os.environ.get("ROUNDS", 5))):
        ids = [(i * 7919 + r * 104729) % (V - 100) + 100 for i in range(N)]
        eng.add_request(f"r{r}", ids, p)
        prof = os.environ.get("PROFILE") == "1" and r == 2
        if prof:
            ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            ctx.__enter__()
        t = time.perf_counter()
        while eng.has_unfinished_requests(): eng.step()
        times.append(time.perf_counter() - t)
        if prof:
            ctx.__exit__(None, None, None)
            print(ctx.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25))
            print(ctx.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print("ms", [round(x * 1e3) for x in times], "tok/s median", round(N / statistics.median(times[1:])))

if __name__ == "__main__":
    main()
