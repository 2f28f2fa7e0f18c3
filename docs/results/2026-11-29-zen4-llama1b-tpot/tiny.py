"""A decode step's fixed cost: a 16-layer Llama with 64-wide layers (the kernels' work ~0),
int4 linears on the kernels, 976 tokens of context, as the 1B's step runs it."""
import sys, time, tempfile, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from tests.conftest import _train_tokenizer, CHATML_TEMPLATE
from transformers import PreTrainedTokenizerFast
from engine import EngineConfig, LLMEngine, SamplingParams
d = Path(tempfile.mkdtemp())
tok = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>")
tok.chat_template = CHATML_TEMPLATE
cfg = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=16, num_attention_heads=4,
                  num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True)
torch.manual_seed(0); LlamaForCausalLM(cfg).save_pretrained(d); tok.save_pretrained(d)
eng = LLMEngine(EngineConfig(model=str(d), max_model_len=4096, quantization="int4", max_num_batched_tokens=1024))
V = eng.vocab_size
prompt = [(i * 31) % (V - 10) + 5 for i in range(976)]
eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
eng.step()
for _ in range(20): eng.step()
steps = []
for _ in range(300):
    t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
print(f"tiny 16-layer step p50 {statistics.median(steps)*1e3:.3f} ms, min {min(steps)*1e3:.3f}")
