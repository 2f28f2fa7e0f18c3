import sys, os, logging, torch
sys.path.insert(0, "/work/main")
from pathlib import Path
def main():
    logging.basicConfig(level=logging.WARNING)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loading.source import resolve_model
    from tests.e2e.conftest import run_requests
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, "/tmp/sm3"); from agree import PROMPTS
    cache = Path("/tmp/sm3/cache")
    for t in sys.argv[1:]:
        path = Path(f"/tmp/sm3/sm3-{t}.gguf")
        src = resolve_model(str(path), cache_dir=cache)
        os.environ["PREFIXGATE_CACHE_DIR"] = str(cache)
        eng = LLMEngine(EngineConfig(model=str(path), max_model_len=1024, kv_cache_memory=64 << 20, dtype="float32"))
        ref = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
        errs = []
        for i, p in enumerate(PROMPTS):
            ids = eng.tokenizer.encode(p)
            [a] = run_requests(eng, [(f"r{i}", ids, SamplingParams(max_tokens=1, temperature=0, logprobs=5), 0)]).values()
            with torch.no_grad():
                r = ref(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            errs.append(max(abs(x.logprob - r[x.token_id].item()) for x in a.logprobs[0].top))
        print(t, "mean %.3f max %.3f" % (sum(errs) / len(errs), max(errs)), flush=True)
if __name__ == "__main__":
    main()
