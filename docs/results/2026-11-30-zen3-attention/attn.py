"""paged_attention alone on SmolLM2's shape (9 query heads over 3 KV heads of 64, float32 over float16): T tokens of context, the last Q as queries; N calls timed. For perf record."""
import sys, time, os
sys.path.insert(0, ".")
import torch
from engine.core.config import default_cache_dir
from engine.executor.kernels import build_cpu_kernels
build_cpu_kernels(default_cache_dir())
op = torch.ops.prefixgate
HEADS, KV, D, B = 9, 3, 64, 16
tokens, queries = int(os.environ.get("T", 1017)), int(os.environ.get("Q", 77))
gen = torch.Generator().manual_seed(1)
blocks = (tokens + B - 1) // B
k = torch.randn(blocks + 2, B, KV, D, generator=gen).half()
v = torch.randn(blocks + 2, B, KV, D, generator=gen).half()
q = torch.randn(queries, HEADS, D, generator=gen)
tables = torch.randperm(blocks + 2, generator=gen)[:blocks][None].long()
rows = torch.zeros(queries, dtype=torch.long)
pos = torch.arange(tokens - queries, tokens)
plan = op.attention_plan(tables, rows, pos, B)
f = lambda: op.paged_attention(q, k, v, tables, rows, pos, *plan, D**-0.5)
for _ in range(20): f()
n = int(os.environ.get("N", 300)); t = time.perf_counter()
for _ in range(n): f()
dt = (time.perf_counter() - t) / n
macs = 2 * HEADS * D * (pos + 1).sum().item()
print(f"{dt*1e3:.3f} ms  {macs/dt/1e9:.1f} GMAC/s  items {plan[0].shape[0]}")
