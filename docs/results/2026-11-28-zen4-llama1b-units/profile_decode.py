"""The 1B's batch-1 decode step in-process at a 976-token context: step p50, then torch's profiler
over 20 steps grouped by input shape: python profile_decode.py."""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from engine import EngineConfig, LLMEngine, SamplingParams
from torch.profiler import profile, ProfilerActivity
M = "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf"
eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
V = eng.vocab_size
prompt = [(i * 7919) % (V - 100) + 100 for i in range(976)]
eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
eng.step()  # prefill
steps = []
for i in range(60):
    t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
steps.sort(); print("step ms p50", round(steps[len(steps)//2]*1e3, 2), "min", round(steps[0]*1e3, 2))
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for i in range(20): eng.step()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25, max_shapes_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
