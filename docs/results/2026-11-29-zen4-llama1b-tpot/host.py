"""Where a 976-token decode step's time goes outside the kernels: the step, the runner's
execute, the model forward, and the sum of the custom ops' times (wrapped)."""
import sys, time, collections
import os; sys.path.insert(0, os.environ.get("REPO", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import torch
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.executor import runner as runner_mod
M = "/root/.cache/prefixgate-bench/llama-3.2-1b-shape-random-q4_k_m.gguf"
eng = LLMEngine(EngineConfig(model=M, max_model_len=2048, max_num_batched_tokens=1024))
V = eng.vocab_size
prompt = [(i * 7919) % (V - 100) + 100 for i in range(976)]
eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
eng.step()
acc = collections.Counter()
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] += time.perf_counter() - t; return r
    return wrapper
R = runner_mod.ModelRunner if hasattr(runner_mod, "ModelRunner") else None
cls = type(eng.__dict__.get("runner") or next(v for v in eng.__dict__.values() if hasattr(v, "execute")))
print("runner class", cls.__name__)
cls.execute = timed("execute", cls.execute)
cls._logits_rows = timed("logits_rows", cls._logits_rows)
cls.build_batch = timed("build_batch", cls.build_batch)
from engine.executor.models import llama as L
from engine.executor import quantization as Q
L.LlamaForCausalLM.forward = timed("model.forward", L.LlamaForCausalLM.forward)
L.LlamaForCausalLM.compute_logits = timed("compute_logits", L.LlamaForCausalLM.compute_logits)
L.LlamaDecoderLayer.forward = timed("layers", L.LlamaDecoderLayer.forward)
L.LlamaAttention.forward = timed("attention module", L.LlamaAttention.forward)
L.LlamaMLP.forward = timed("mlp module", L.LlamaMLP.forward)
Q.HeadRowsEmbedding.forward = timed("embedding", Q.HeadRowsEmbedding.forward)

ops = torch.ops.prefixgate
for name in ("quant_matmul", "paged_attention", "add_rms_norm", "silu_and_mul", "rope_and_cache", "argmax_rows", "attention_plan"):
    packet = getattr(ops, name)
    setattr(ops, name, timed("op " + name, packet))
for i in range(10): eng.step()
acc.clear()
N = 100
t0 = time.perf_counter()
for i in range(N): eng.step()
total = time.perf_counter() - t0
print(f"step {total/N*1e3:.2f} ms")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k}: {v/N*1e3:.3f} ms")
