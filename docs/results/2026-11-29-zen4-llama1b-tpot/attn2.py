"""Decode attention as the engine lays it out: one [layers, 4096 blocks, 16, 8, 64] bf16 pool
per K and V, the sequence's 62 blocks in id order, 16 layers, and ~50 MB of other reads
(the linears) between layers."""
import os, time, torch, sys
so = os.environ["SO"]; torch.ops.load_library(so); op = torch.ops.prefixgate
torch.manual_seed(0)
H, KV, D, B, L, NB = 32, 8, 64, 16, 16, 4096
ctx = int(os.environ.get("CTX", 976)); nblk = (ctx + B - 1) // B
kc = torch.empty(L, NB, B, KV, D, dtype=torch.bfloat16); vc = torch.empty_like(kc)
kc[:, :nblk + 1].normal_(); vc[:, :nblk + 1].normal_()
q = torch.randn(1, H, D).bfloat16()
tables = torch.arange(nblk + 1).long()[None]
rows = torch.zeros(1, dtype=torch.long); pos = torch.tensor([ctx - 1])
plan = op.attention_plan(tables, rows, pos, B, 0)
weights = torch.empty(3_500_000, dtype=torch.float32).normal_()  # 14 MB a "linear"
FLUSH = int(os.environ.get("FLUSH", 1))
def run():
    t = 0.0
    for l in range(L):
        if FLUSH:
            for _ in range(4): weights.sum()
        s = time.perf_counter()
        op.paged_attention(q, kc[l], vc[l], tables, rows, pos, *plan, 0.125, 0)
        t += time.perf_counter() - s
    return t
ts = sorted(run() for _ in range(int(os.environ.get("N", 40))))
print(f"attention, 16 layers (flush {FLUSH}): p50 {ts[len(ts)//2]*1e3:.3f} ms, min {ts[0]*1e3:.3f}")
