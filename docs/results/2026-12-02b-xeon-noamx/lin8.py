"""SmolLM2's linear shapes at ROWS rows (default 8) on the kernel, one thread then two: median us
and G multiply-adds/s over 200 calls, weights in cache (the same weight over and over)."""
import os, sys, time, statistics, torch
sys.path.insert(0, os.getcwd())
from engine.executor.kernels import load_cpu_kernels
from engine.core.config import default_cache_dir
from engine.executor.quantization import quantize_weight
assert load_cpu_kernels(default_cache_dir())
torch.manual_seed(0)
shapes = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4), "head": (49152, 576, 8)}
rows = int(os.environ.get("ROWS", 8))
ws = {k: quantize_weight(torch.randn(n, kk) * 0.02, b, torch.bfloat16)[0] for k, (n, kk, b) in shapes.items()}
xs = {k: torch.randn(rows, kk).to(torch.bfloat16) for k, (n, kk, b) in shapes.items()}
for t in (1, 2):
    torch.set_num_threads(t)
    out = []
    for k, w in ws.items():
        x = xs[k]
        for _ in range(20): w.matmul(x)
        ts = []
        for _ in range(200):
            a = time.perf_counter(); w.matmul(x); ts.append(time.perf_counter() - a)
        n, kk, b = shapes[k]
        med = statistics.median(ts)
        out.append(f"{k} {med*1e6:.0f}us {rows*n*kk/med/1e9:.0f}G")
    print(f"threads={t}", " | ".join(out))
