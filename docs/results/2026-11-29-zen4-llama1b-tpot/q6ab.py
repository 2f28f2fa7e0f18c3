"""Q6_K linears of the 1B, the two-row layout (d per half, no m) against three rows (with a
-0.0 m row), alternating call by call in one process: ms per call and GB/s."""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from pathlib import Path
from engine.executor.kernels import load_cpu_kernels
from engine.core.config import default_cache_dir
from engine.executor.quantization import pack_weight
from engine.loading.gguf import GGUFTable, GGUFWeights
from transformers import AutoConfig
load_cpu_kernels(default_cache_dir())
M = Path("/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
table = GGUFTable.parse(M)
from types import SimpleNamespace
w = GGUFWeights(M, table, SimpleNamespace(num_attention_heads=32, num_key_value_heads=8))
names = [n for n in w.names() if n.endswith("down_proj.weight") and w.entries[n].kind == "Q6_K"][:4] + ["model.embed_tokens.weight"]
for name in names:
    c = w.group_codes(name)
    two = pack_weight(c.codes, c.d, c.m, c.bits, factors=c.factors)
    three = pack_weight(c.codes, c.d, c.m, c.bits, with_min=True, factors=c.factors)
    assert two.scales.shape[2] == 2 and three.scales.shape[2] == 3
    x = torch.randn(1, two.in_features).bfloat16()
    assert torch.equal(two.matmul(x), three.matmul(x))
    # weights from memory: a 256 MB buffer streamed between calls
    flush = torch.empty(64 << 20, dtype=torch.float32)
    t = {2: [], 3: []}
    for i in range(40 if "embed" in name else 200):
        for k, wt in (((2, two), (3, three)) if i % 2 else ((3, three), (2, two))):
            flush.add_(1.0)
            s = time.perf_counter(); wt.matmul(x); t[k].append(time.perf_counter() - s)
    for k, wt in ((2, two), (3, three)):
        ts = sorted(t[k]); p = ts[len(ts) // 2]
        print(f"{name.split('.')[-3] if 'embed' not in name else 'head'} {tuple(c.codes.shape[:2])} rows {k}: {p*1e3:.3f} ms {wt.num_bytes/p/1e9:.1f} GB/s ({wt.num_bytes/1e6:.1f} MB)")
