"""A small random model of ARCH, with SmolLM2's tokenizer, converted by llama.cpp's converter (F32)."""
import sys, torch, subprocess
from pathlib import Path
sys.path.insert(0, "/work/main")
from transformers import AutoTokenizer
from engine.loading.source import resolve_model
from tools.peers import llama_converter, llama_quantize
arch = sys.argv[1]
out = Path("/tmp/arch") / arch; out.mkdir(exist_ok=True); folder = out / "hf"
tok = AutoTokenizer.from_pretrained(resolve_model(None).path, local_files_only=True)
common = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None, tie_word_embeddings=True)
if arch == "qwen3":
    from transformers import Qwen3Config as C, Qwen3ForCausalLM as M
    cfg = C(**common, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
elif arch == "phi3":
    from transformers import Phi3Config as C, Phi3ForCausalLM as M
    cfg = C(**common, partial_rotary_factor=0.75)
elif arch == "llama":
    from transformers import LlamaConfig as C, LlamaForCausalLM as M
    cfg = C(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
elif arch == "qwen2":
    from transformers import Qwen2Config as C, Qwen2ForCausalLM as M
    cfg = C(**common)
torch.manual_seed(0)
m = M(cfg)
with torch.no_grad():
    for n, p in m.named_parameters():
        if p.dim() == 2: p.normal_(0, 0.08)
        elif "norm" in n: p.copy_(1 + 0.3 * torch.randn_like(p))
        else: p.normal_(0, 0.1)
    m.model.embed_tokens.weight.normal_(0, 0.4)
m = m.to(torch.bfloat16)
m.save_pretrained(folder); tok.save_pretrained(folder)
subprocess.run([sys.executable, str(llama_converter()), str(folder), "--outtype", "f32", "--outfile", str(out / f"{arch}-f32.gguf")], check=True, capture_output=True)
print(out / f"{arch}-f32.gguf")
