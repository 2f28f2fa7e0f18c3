import os, sys, time, collections
sys.path.insert(0, "/work/main")
import torch
from engine import EngineConfig, LLMEngine
from engine.executor.quantization import kernel_linears

def main():
    M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
    rows = int(os.environ.get("ROWS", 77))
    eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, speculative="off"))
    model = eng.runner.model
    agg = collections.defaultdict(lambda: [0.0, 0, 0])
    for lin in kernel_linears(model)[:int(os.environ.get("NLIN", 200))]:
        for part in lin.parts:
            if os.environ.get("BITS") and part.bits != int(os.environ["BITS"]): continue
            x = torch.randn(rows, part.in_features, dtype=torch.float32)
            part.matmul(x)
            best = 1e9
            for _ in range(int(os.environ.get("REPS", 5))):
                t = time.perf_counter(); part.matmul(x); best = min(best, time.perf_counter() - t)
            key = (part.bits, part.halves, part.factors is not None, part.out_features, part.in_features)
            a = agg[key]; a[0] += best; a[1] += 1; a[2] = part.out_features * part.in_features * rows
    tot = 0
    for k, (t, n, macs) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        tot += t
        print(f"bits {k[0]} halves {k[1]} factors {k[2]} N {k[3]} K {k[4]}: {n} calls, {t*1e3:.1f} ms, {macs*n/t/1e9:.1f} G MAC/s")
    print(f"total {tot*1e3:.1f} ms")

if __name__ == "__main__":
    main()
