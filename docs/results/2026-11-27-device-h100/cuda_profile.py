"""Where does a decode step go on CUDA, bf16 against float32? The real model, 8 intent requests
at once, 32 tokens, after a warm-up; torch.profiler's op table for each dtype."""
import os, sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, str(Path.cwd()))
from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids
MESSAGES = ["I want a refund for my last order", "How do I reset my password?", "Cancel my subscription please",
            "Where is my package?", "The app crashes when I upload photos", "Can I change my delivery address?",
            "I was charged twice", "Do you ship to Canada?"]
def main():
    for dtype in os.environ.get("DTYPES", "bfloat16,float32").split(","):
        e = LLMEngine(EngineConfig(device=os.environ.get("DEVICE", "cuda"), dtype=dtype, kv_cache_memory=256 << 20,
                                   max_model_len=2048, prefix_file="prefixes.yaml"))
        [spec] = [s for s in e.prefixes.specs if s.name == "intent-classifier"]
        history = [{"role": r, "content": c} for r, c in spec.messages]
        prompts = [chat_prompt_ids(e.tokenizer, [*history, {"role": "user", "content": m}]) for m in MESSAGES]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        e.generate(prompts, params)
        for batch in (1, 8):
            start = time.perf_counter(); e.generate(prompts[:batch], params); wall = time.perf_counter() - start
            print(f"{dtype} batch {batch}: {wall*1000:.0f} ms for 32 tokens ({wall*1000/32:.1f} ms a step)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            e.generate(prompts[:1], params)
        print(f"== {dtype}, batch 1, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        print(f"== {dtype}, batch 1, by CUDA time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        del e
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
