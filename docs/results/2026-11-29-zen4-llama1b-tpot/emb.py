import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from pathlib import Path
from types import SimpleNamespace
from engine.executor.kernels import load_cpu_kernels
from engine.executor.quantization import pack_weight, dequantize_rows
from engine.loading.gguf import GGUFTable, GGUFWeights
load_cpu_kernels(Path.home() / ".cache/prefixgate")
M = Path("/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
w = GGUFWeights(M, GGUFTable.parse(M), SimpleNamespace(num_attention_heads=32, num_key_value_heads=8))
c = w.group_codes("model.embed_tokens.weight")
q = pack_weight(c.codes, c.d, c.m, c.bits, factors=c.factors)
ids = torch.tensor([12345])
for _ in range(50): dequantize_rows(q, ids)
s = time.perf_counter()
for _ in range(500): dequantize_rows(q, ids)
print(f"dequantize_rows n=1: {(time.perf_counter() - s) / 500 * 1e6:.0f} us")
from torch.profiler import profile
with profile() as prof:
    for _ in range(50): dequantize_rows(q, ids)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
for _ in range(50): q.rows(ids)
s = time.perf_counter()
for _ in range(2000): q.rows(ids)
print(f"op n=1: {(time.perf_counter() - s) / 2000 * 1e6:.1f} us")
many = torch.randint(0, 128256, (1000,))
s = time.perf_counter(); a = dequantize_rows(q, many); t1 = time.perf_counter() - s
s = time.perf_counter(); b = q.rows(many); t2 = time.perf_counter() - s
print(f"1000 rows: torch {t1*1e3:.2f} ms, op {t2*1e3:.2f} ms, equal {torch.equal(a.view(torch.int32), b.view(torch.int32))}")
