"""Batch-1 quant_matmul on the 1B's linear shapes (random codes), from memory and hot in cache.

    SO=<a built prefixgate_kernels_*.so> python linears_batch1.py [threads]

Loads the built library directly (torch.ops.load_library), so two builds of different source
can be compared in turns. "mem": enough copies of the weight to exceed the caches, each
called once; "hot": one copy called as many times. For the layout of 8e57c57 and after
(units of two tiles; the op takes N)."""

import sys
import time
import os

import torch

torch.ops.load_library(os.environ["SO"])
op = torch.ops.prefixgate.quant_matmul
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def make(n, k, bits, parts):
    codes = torch.randint(0, 256, (n // 16, k // 32, 64 * bits), dtype=torch.uint8)
    scales = torch.randint(-60, 60, (n // 16, k // 32, parts, 16), dtype=torch.int8)
    factors = (torch.rand(n // 16, k // 256, parts, 16) * 1e-3).half()
    return codes, scales, factors


CASES = [
    ("q4k 2048x2048", 2048, 2048, 4, 2),
    ("q4k gate_up 16384x2048", 16384, 2048, 4, 2),
    ("q4k down 2048x8192", 2048, 8192, 4, 2),
    ("q6k head 128256x2048", 128256, 2048, 6, 3),
    ("q6k down 2048x8192", 2048, 8192, 6, 3),
]
for name, n, k, bits, parts in CASES:
    one = make(n, k, bits, parts)
    size = sum(t.nbytes for t in one)
    ws = [one] + [make(n, k, bits, parts) for _ in range(max(1, int(300e6 // size)) - 1)]
    x = torch.randn(1, k, dtype=torch.bfloat16)
    for w in ws:
        op(x, w[0], w[1], bits, n, w[2])
    best_mem = best_hot = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for w in ws:
            op(x, w[0], w[1], bits, n, w[2])
        best_mem = min(best_mem, (time.perf_counter() - t) / len(ws))
        t = time.perf_counter()
        for _ in ws:
            op(x, one[0], one[1], bits, n, one[2])
        best_hot = min(best_hot, (time.perf_counter() - t) / len(ws))
    print(f"{name:24s} {size / 1e6:6.1f} MB  mem {best_mem * 1e3:6.3f} ms "
          f"{size / best_mem / 1e9:5.1f} GB/s  hot {best_hot * 1e3:6.3f} ms {size / best_hot / 1e9:5.1f} GB/s")
