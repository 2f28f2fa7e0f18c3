"""paged_attention at 77 queries over 1,020 keys, by head layout: G multiply-adds/s (this build)."""
import sys, os, time
sys.path.insert(0, os.getcwd())
import torch
from functools import partial
import tools.bench_kernels as bk
op = bk.build(None)
BLOCK, HD = 16, 64
tokens, queries = 1021, 77
for heads, kv in [(9, 3), (12, 3), (8, 8), (16, 4), (32, 8), (32, 4), (16, 8)]:
    gen = torch.Generator().manual_seed(1)
    blocks = (tokens + BLOCK - 1) // BLOCK
    k = torch.randn(blocks + 2, BLOCK, kv, HD, generator=gen).half()
    v = torch.randn(blocks + 2, BLOCK, kv, HD, generator=gen).half()
    q = torch.randn(queries, heads, HD, generator=gen)
    tables = torch.randperm(blocks + 2, generator=gen)[:blocks][None].long()
    rows = torch.zeros(queries, dtype=torch.long)
    pos = torch.arange(tokens - queries, tokens)
    plan = op.attention_plan(tables, rows, pos, BLOCK)
    f = partial(op.paged_attention, q, k, v, tables, rows, pos, *plan, HD ** -0.5)
    f(); best = 1e9
    for _ in range(30):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    keys = (pos + 1).sum().item()
    print(f"heads {heads:2d} kv {kv}: {best*1e3:.2f} ms, {2*heads*HD*keys/best/1e9:.1f} G MAC/s")
