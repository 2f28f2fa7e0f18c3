import sys, time, torch
sys.path.insert(0, "/work/main")
from tools.bench_kernels import build
ops = [build("HEAD"), build(None)]
BLOCK, KVH, HD, H = 16, 3, 64, 9
tokens, batch, layers = 1000, int(sys.argv[1]), 30
pool_blocks = 6000
g = torch.Generator().manual_seed(0)
shared = tokens * 15 // 16 // BLOCK; own = (tokens + BLOCK - 1) // BLOCK - shared
perm = torch.randperm(pool_blocks, generator=g)
tables = torch.tensor([perm[:shared].tolist() + perm[shared + b * own: shared + (b + 1) * own].tolist() for b in range(batch)])
rows = torch.arange(batch); positions = torch.full((batch,), tokens - 1) - torch.arange(batch) * 7
q = torch.randn(batch, H, HD, generator=g).bfloat16()
ks = [torch.randn(pool_blocks, BLOCK, KVH, HD, generator=g).bfloat16() for _ in range(layers)]
vs = [torch.randn(pool_blocks, BLOCK, KVH, HD, generator=g).bfloat16() for _ in range(layers)]
def step(op):
    plan = op.attention_plan(tables, rows, positions, BLOCK, 0)
    return torch.stack([op.paged_attention(q, k, v, tables, rows, positions, *plan, HD ** -0.5, 0) for k, v in zip(ks, vs)])
outs = [step(op) for op in ops]
print("same bits", torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)))
best = [1e9, 1e9]
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for i, op in enumerate(ops):
        t = time.perf_counter(); step(op); best[i] = min(best[i], (time.perf_counter() - t) / layers)
print(f"B={batch}: HEAD {best[0]*1e6:.1f} us/layer, working tree {best[1]*1e6:.1f} us/layer")
