"""Decode at a 976-token context, two engines of one model in one process alternated round by
round; LAYOUTS=joined,blocks (load order) picks each one's layout for a fused linear of mixed
code widths: one layout at the widest width (before 1b9237c) or row blocks. The quantized
cache is neither read nor written (it would hand the second engine the first's layout)."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("REPO", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import engine.loading.gguf as g
import engine.loading.quantized_cache as qc
from pathlib import Path
from engine import EngineConfig, LLMEngine
from ab_two import alternate
qc.write = lambda model, path: None
qc.cache_file = lambda *a: Path("/nonexistent/none.safetensors")
M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
real = g.row_blocks
def joined_blocks(parts):
    return [parts[0] if len(parts) == 1 else g.GroupCodes.cat(parts)]
engines = []
for i, layout in enumerate(os.environ.get("LAYOUTS", "joined,blocks").split(",")):
    g.row_blocks = joined_blocks if layout == "joined" else real
    e = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
    from tools.bench_decode_step import weight_bytes_per_step
    print(f"engine {i} {layout}: {weight_bytes_per_step(e)/1e6:.1f} MB", flush=True)
    engines.append((e, f"{i}-{layout}"))
alternate(engines, int(os.environ.get("ROUNDS", 10)))
