import sys, time, statistics
sys.path.insert(0, "/work/main")
import torch
from engine.core.config import default_cache_dir
from engine.executor.kernels import load_cpu_kernels
from engine.executor.quantization import pack_weight
load_cpu_kernels(default_cache_dir())
g = torch.Generator().manual_seed(0)
N, K, L = 4096, 640, 18
ws = {5: [], 8: []}
for _ in range(L):
    codes = torch.randint(0, 32, (N, K // 32, 32), generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half()
    ws[5].append(pack_weight(codes, d, (d.float() * -16).half(), 5))
    ws[8].append(pack_weight(codes - 16, d, torch.zeros_like(d), 8))
print("MB per layer", {b: round((w[0].codes.nbytes + w[0].scales.nbytes) / 1e6, 2) for b, w in ws.items()})
for rows in (1, 128):
    x = torch.randn(rows, K)
    res = {5: [], 8: []}
    for rep in range(15):
        for b in (5, 8):
            t = time.perf_counter()
            for w in ws[b]:
                torch.ops.prefixgate.quant_matmul(x, w.codes, w.scales, b)
            res[b].append((time.perf_counter() - t) / L)
    print("rows", rows, {b: round(statistics.median(v) * 1e3, 3) for b, v in res.items()}, "ms per layer (p50)", {b: round(min(v) * 1e3, 3) for b, v in res.items()}, "min")
