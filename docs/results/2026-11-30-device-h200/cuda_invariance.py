"""Same request, same answer on CUDA? Ten intent requests and five chats on the real model,
greedy: each alone on a fresh engine, then all at once on another; count the answers that differ."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids
import ast
import types

# tests/e2e/conftest.py imports openai (not on the device image): stand in for it with a stub
# that holds every name test_smollm2_invariance imports from it (read from the file itself, so a
# name added there later does not break this script). This script uses none of them.
_TEST = Path.cwd() / "tests" / "e2e" / "test_smollm2_invariance.py"
_stub = types.ModuleType("tests.e2e.conftest")
for _node in ast.walk(ast.parse(_TEST.read_text())):
    if isinstance(_node, ast.ImportFrom) and _node.module == "tests.e2e.conftest":
        for _alias in _node.names:
            setattr(_stub, _alias.asname or _alias.name, None)
sys.modules["tests.e2e.conftest"] = _stub
from tests.e2e.test_smollm2_invariance import CHAT_QUESTIONS, CUSTOMER_MESSAGES


def registry_chat(engine, name, question):
    [spec] = [s for s in engine.prefixes.specs if s.name == name]
    history = [{"role": role, "content": content} for role, content in spec.messages]
    return chat_prompt_ids(engine.tokenizer, [*history, {"role": "user", "content": question}])

DEVICE = os.environ.get("DEVICE", "cuda")
N = int(os.environ.get("N", "99"))
def main():
    for dtype in os.environ.get("DTYPES", "bfloat16,float32").split(","):
        def engine(**kw) -> LLMEngine:
            return LLMEngine(EngineConfig(device=DEVICE, dtype=dtype, kv_cache_memory=256 << 20,
                                          max_model_len=2048, prefix_file="prefixes.yaml", **kw))
        e = engine()
        lone = engine(enable_auto_prefix_cache=False)  # one at a time, nothing cached but the registry
        prompts = [registry_chat(e, "intent-classifier", m) for m in CUSTOMER_MESSAGES]
        prompts += [chat_prompt_ids(e.tokenizer, [{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
        prompts = prompts[:N]
        params = SamplingParams(temperature=0, max_tokens=32)
        alone = []
        for p in prompts:
            alone.append(lone.generate([p], params)[0])
        together = e.generate(prompts, params)
        again = e.generate(prompts, params)  # now every prompt is in the automatic cache
        diff1 = [i for i in range(len(prompts)) if alone[i] != together[i]]
        diff2 = [i for i in range(len(prompts)) if alone[i] != again[i]]
        print(f"{dtype}: {len(prompts)} prompts; differ together {len(diff1)} {diff1}; differ cached {len(diff2)} {diff2}")
        for i in diff1[:2]:
            print("  alone:   ", e.tokenizer.decode(alone[i]))
            print("  together:", e.tokenizer.decode(together[i]))
        del e, lone
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
