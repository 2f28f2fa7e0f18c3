import sys, torch, subprocess
from pathlib import Path
sys.path.insert(0, "/work/main")
from transformers import AutoTokenizer, SmolLM3Config, SmolLM3ForCausalLM
from engine.loading.source import resolve_model
from tools.peers import llama_converter, llama_quantize
out = Path("/tmp/sm3"); folder = out / "hf"
tok = AutoTokenizer.from_pretrained(resolve_model(None).path, local_files_only=True)
cfg = SmolLM3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
print(cfg.no_rope_layers, cfg.layer_types[:4], cfg.use_sliding_window)
torch.manual_seed(0)
m = SmolLM3ForCausalLM(cfg).to(torch.bfloat16)
with torch.no_grad():
    for p in m.parameters():
        if p.dim() == 2: p.normal_(0, 0.08)
    m.model.embed_tokens.weight.normal_(0, 0.4)
m.save_pretrained(folder); tok.save_pretrained(folder)
subprocess.run([sys.executable, str(llama_converter()), str(folder), "--outtype", "f32", "--outfile", str(out/"sm3-f32.gguf")], check=True)
subprocess.run([str(llama_quantize()), str(out/"sm3-f32.gguf"), str(out/"sm3-q4_k_m.gguf"), "Q4_K_M", "2"], check=True)
