"""Top-10 logprob error of the engine vs transformers float32 over the GGUF's dequantized
weights (as tests/e2e/test_gemma3.py), and the weight formats served."""
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, "/work/main")
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading.source import resolve_model, shipped_weight_format
from tests.e2e.test_gemma3 import PROMPTS, LONG
from tests.e2e.conftest import run_requests
from transformers import AutoModelForCausalLM

def main():
    path = Path(sys.argv[1])
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=2048, kv_cache_memory=128 << 20))
    print("engine up in %.1f s" % (time.perf_counter() - t))
    print("formats:", shipped_weight_format(resolve_model(str(path))).describe(torch.float32))
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in [*PROMPTS, LONG]]
    folder = resolve_model(str(path)).path
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=10)
    errors, same = [], 0
    for i, prompt in enumerate(prompts):
        [answer] = run_requests(engine, [(f"r{i}", prompt, params, 0)]).values()
        (ours,) = answer.logprobs
        with torch.no_grad():
            ref = ref_model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        errors.append(max(abs(t.logprob - ref[t.token_id].item()) for t in ours.top))
        same += ours.token_id == int(ref.argmax())
    print("errors:", " ".join(f"{e:.2f}" for e in errors))
    print("mean %.3f max %.3f; same first token %d of %d" % (sum(errors) / len(errors), max(errors), same, len(errors)))


if __name__ == "__main__":
    main()
