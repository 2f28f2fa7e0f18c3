import sys, time, statistics
sys.path.insert(0, "/work/main")
import torch
from engine.core.config import default_cache_dir
from engine.executor.kernels import load_cpu_kernels
from engine.executor.quantization import quantize_weight
load_cpu_kernels(default_cache_dir())
torch.manual_seed(0)
N, K = 262144, 640
q, _ = quantize_weight(torch.randn(N, K), 8)
s1 = q.scales; s2 = torch.cat([s1, torch.zeros_like(s1)], 1)
x = torch.randn(1, K)
res = {1: [], 2: []}
for rep in range(30):
    for r, s in ((1, s1), (2, s2)):
        t = time.perf_counter(); torch.ops.prefixgate.quant_matmul(x, q.codes, s, 8); res[r].append(time.perf_counter() - t)
for r in res: print("rows", r, "p50 ms", round(statistics.median(res[r]) * 1e3, 3), "min", round(min(res[r]) * 1e3, 3))
