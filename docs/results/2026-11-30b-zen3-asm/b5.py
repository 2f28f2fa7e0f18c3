"""5-bit (Q5_0-like: a d per group, no min; Q5_1-like with one) quant_matmul: working tree vs a
revision, in turns.   OMP_NUM_THREADS=1 .venv/bin/python b5.py REV ROWS,.. NxK,..  (repository root)"""
import sys, os
sys.path.insert(0, os.getcwd())
from functools import partial
import torch
from tools.bench_kernels import build, in_turns
from engine.executor.quantization import pack_weight
against = sys.argv[1]; rows_list = [int(r) for r in sys.argv[2].split(",")]
shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[3].split(",")]
ops = [build(against), build(None)]
gen = torch.Generator().manual_seed(5)
for mins in (False, True):
    for rows in rows_list:
        tot = [0.0, 0.0]; same = True; macs = 0
        for n, k in shapes:
            groups = k // 32
            codes = torch.randint(0, 32, (n, groups, 32), generator=gen).to(torch.int8)
            d = (torch.rand(n, groups, generator=gen) * 0.01).half().float()
            m = (torch.rand(n, groups, generator=gen) * 0.01).half().float() if mins else torch.zeros(n, groups)
            w = pack_weight(codes, d, m, 5)
            x = torch.randn(rows, k, generator=gen)
            calls = [partial(op.quant_matmul, x, w.codes, w.scales, w.op_bits, n, w.factors, w.halves) for op in ops]
            best, eq = in_turns(calls, int(os.environ.get("ROUNDS", 15)))
            tot = [a + b for a, b in zip(tot, best)]; same = same and eq; macs += rows * n * k
        print({"mins": mins, "rows": rows, "ms": [round(t * 1e3, 2) for t in tot], "gmac": [round(macs / t / 1e9, 1) for t in tot], "same_bits": same, "threads": torch.get_num_threads()})
