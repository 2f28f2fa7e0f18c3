"""Each quantized linear of a model at ROWS rows (default 77), best of 5 calls, summed by
tensor type and shape: THREADS=2 MODEL=x.gguf .venv/bin/python linears.py (repository root)."""
import os, sys, time, collections
sys.path.insert(0, os.getcwd())
import torch
from engine import EngineConfig, LLMEngine
from engine.executor.quantization import kernel_linears
torch.set_num_threads(int(os.environ.get("THREADS", 1)))
rows = int(os.environ.get("ROWS", 77))
kw = {"model": os.environ["MODEL"]} if os.environ.get("MODEL") else {}
eng = LLMEngine(EngineConfig(max_model_len=2048, speculative="off", **kw))
agg = collections.defaultdict(lambda: [0.0, 0, 0])
for lin in kernel_linears(eng.runner.model):
    for part in lin.parts:
        x = torch.randn(rows, part.in_features)
        part.matmul(x)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter(); part.matmul(x); best = min(best, time.perf_counter() - t)
        key = (part.bits, part.halves, part.factors is not None, part.out_features, part.in_features)
        a = agg[key]; a[0] += best; a[1] += 1; a[2] = part.out_features * part.in_features * rows
for k, (t, n, macs) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
    print(f"bits {k[0]} halves {k[1]} factors {k[2]} N {k[3]} K {k[4]}: {n} calls, {t*1e3:.1f} ms, {macs*n/t/1e9:.1f} G MAC/s")
