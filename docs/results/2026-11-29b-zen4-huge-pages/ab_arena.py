"""Decode at a 976-token context, two engines of one model in one process alternated round by
round; ARENA=1,0 (load order) says which one keeps its kernel weights on 2 MB pages."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("REPO", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import engine.loading.quantized_cache as qc
import engine.loading.build as b
from engine import EngineConfig, LLMEngine
from ab_two import alternate
M = os.environ.get("MODEL", "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf")
engines = []
for i, arena in enumerate(os.environ.get("ARENA", "1,0").split(",")):
    # the build path moves the weights, the cached path reads them into an arena: both off
    b.huge_pages_available = qc.huge_pages_available = (lambda on=arena == "1": on)
    e = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
    engines.append((e, f"{i}-arena{arena}"))
alternate(engines, int(os.environ.get("ROUNDS", 10)))
