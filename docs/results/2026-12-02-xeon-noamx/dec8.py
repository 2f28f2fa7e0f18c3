"""Decode steps of N requests sharing a 944-token prefix (an `intent` decode step at
concurrency N), in-process: median step ms over STEPS steps; PROFILE=1 prints torch.profiler's
table for those steps. MODEL, N, STEPS, SPEC (auto/off) from the environment."""
import os, sys, time, statistics
sys.path.insert(0, os.getcwd())  # run from the repository root
import torch
from engine import EngineConfig, LLMEngine, SamplingParams

def main():
    M = os.environ.get("MODEL")
    n, steps = int(os.environ.get("N", 8)), int(os.environ.get("STEPS", 40))
    kw = {"model": M} if M else {}
    eng = LLMEngine(EngineConfig(max_model_len=2048, speculative=os.environ.get("SPEC", "off"), **kw))
    V = eng.vocab_size
    prefix = [(i * 7919) % (V - 100) + 100 for i in range(944)]
    p = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for r in range(n):
        eng.add_request(f"r{r}", prefix + [(i * 31 + r * 977) % (V - 100) + 100 for i in range(77)], p)
    for _ in range(10):  # prefills, then a few decode steps
        eng.step()
    prof = os.environ.get("PROFILE") == "1"
    if prof:
        ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        ctx.__enter__()
    times = []
    for _ in range(steps):
        t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
    if prof:
        ctx.__exit__(None, None, None)
        print(ctx.key_averages(group_by_input_shape=os.environ.get("SHAPES") == "1").table(sort_by="self_cpu_time_total", row_limit=16))
    print(os.environ.get("LABEL", ""), f"N={n} step ms median", round(statistics.median(times) * 1e3, 2),
          "p10/p90", [round(x * 1e3, 2) for x in statistics.quantiles(times, n=10)[::8]])

if __name__ == "__main__":
    main()
