"""SmolLM2: the intent workload's registry-hit step (~36 new tokens after the 940-token entry), timed; PROFILE=1 profiles one. Run from the repository root."""
import os, sys, time, statistics
sys.path.insert(0, ".")
import torch
from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids

MSGS = ["I was charged twice for my subscription this month and I want the extra charge refunded to my card please, thanks so much",
        "My package says delivered but it is not at my door and the neighbours have not seen it either, what can I do now?",
        "How do I change the email address on my account? The old one was from my previous job and I can no longer log in there.",
        "The app keeps crashing whenever I open the settings page on my phone after the last update, please help me fix it soon"]

def main():
    eng = LLMEngine(EngineConfig(prefix_file="prefixes.yaml", speculative="off", enable_auto_prefix_cache=False))
    [spec] = [s for s in eng.prefixes.specs if s.name == "intent-classifier"]
    hist = [{"role": r, "content": c} for r, c in spec.messages]
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(int(os.environ.get("ROUNDS", 8))):
        ids = chat_prompt_ids(eng.tokenizer, [*hist, {"role": "user", "content": MSGS[r % 4] + f" (ticket {r})"}])
        eng.add_request(f"r{r}", ids, p)
        prof = os.environ.get("PROFILE") == "1" and r == 3
        if prof:
            ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]); ctx.__enter__()
        t = time.perf_counter()
        while eng.has_unfinished_requests(): eng.step()
        times.append(time.perf_counter() - t)
        if prof:
            ctx.__exit__(None, None, None)
            print(ctx.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    print("prompt", len(ids), "ms", [round(x * 1e3) for x in times], "median", round(1e3 * statistics.median(times[1:])))

if __name__ == "__main__":
    main()
