"""Decode attention at a 976-token context, 16 layers' caches, the 1B's shape."""
import os, time, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
so = os.environ.get("SO")
if so:
    torch.ops.load_library(so); op = torch.ops.prefixgate
else:
    from engine.executor import kernels; from pathlib import Path; kernels.load_cpu_kernels(Path.home()/".cache/prefixgate"); op = torch.ops.prefixgate
torch.manual_seed(0)
H, KV, D, B = 32, 8, 64, 16
ctx = int(os.environ.get("CTX", 976))
nblk = (ctx + B) // B + 1
L = int(os.environ.get("L", 16))
kc = [torch.randn(nblk, B, KV, D).bfloat16() for _ in range(L)]
vc = [torch.randn(nblk, B, KV, D).bfloat16() for _ in range(L)]
q = torch.randn(1, H, D).bfloat16()
tables = torch.arange(nblk).long()[None]
rows = torch.zeros(1, dtype=torch.long); pos = torch.tensor([ctx - 1])
plan = op.attention_plan(tables, rows, pos, B, 0)
def run():
    for l in range(L):
        out = op.paged_attention(q, kc[l], vc[l], tables, rows, pos, *plan, 0.125, 0)
    return out
ref = run()
ts = []
for _ in range(int(os.environ.get("N", 200))):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
ts.sort()
print(f"ctx {ctx}: {L} layers p50 {ts[len(ts)//2]*1e3:.3f} ms min {ts[0]*1e3:.3f} ms  per layer {ts[len(ts)//2]*1e6/L:.0f} us; items {plan[0].shape[0]}")
torch.save(ref, os.environ.get("REF_OUT", "/tmp/mb/attn_ref.pt"))
