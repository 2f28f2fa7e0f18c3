import sys, time, torch
sys.path.insert(0, "/work/main")
from engine import EngineConfig, LLMEngine, SamplingParams
from torch.profiler import profile, ProfilerActivity
M = "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf"
eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
V = eng.vocab_size
prefix = [(i * 7919) % (V - 100) + 100 for i in range(896)]
def run(name, ids):
    eng.add_request(name, ids, SamplingParams(temperature=0, max_tokens=1))
    t = time.perf_counter()
    while eng.has_unfinished_requests(): eng.step()
    return time.perf_counter() - t
print("prefix", run("p", prefix))
times = []
for r in range(4):
    suffix = [(i * 104729 + r * 31) % (V - 100) + 100 for i in range(80)]
    times.append(run(f"s{r}", prefix + suffix))
print("suffix 80 after 896 cached:", [round(t * 1e3) for t in times])
suffix = [(i * 104729 + 999) % (V - 100) + 100 for i in range(80)]
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    run("prof", prefix + suffix)
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_shapes_column_width=90))
