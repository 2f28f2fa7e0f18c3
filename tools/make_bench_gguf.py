"""A 1B-class benchmark model made the way users' GGUFs are made: Llama 3.2 1B's shape with
random weights, converted by llama.cpp's own `convert_hf_to_gguf.py` and quantized by its
`llama-quantize` (both from the sources `tools/peers.py build llama-cpp` unpacks and builds).

    .venv/bin/pip install -e ".[bench]"   # sentencepiece, which the converter imports
    .venv/bin/python tools/make_bench_gguf.py [--out DIR] [--type Q4_K_M]

Prints the GGUF's path. Why random weights: no 1B model ships on PyPI and nothing may be
downloaded from a hub; speed depends on the shape and the tensor types, not on the values.
The tokenizer is SmolLM2's (from the embedded model's conversion), padded by the converter
to Llama 3's 128,256 ids so the head has the real model's size. The padded ids' rows of the
tied embedding are zero: their logits are 0 while the best real token's is positive, so
greedy decoding writes real tokens (text both servers stream), never padding.
Steps already done (the HF folder, the F16 GGUF) are reused.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.peers import build_llama_cpp, llama_converter, llama_quantize

# Llama 3.2 1B (meta-llama/Llama-3.2-1B-Instruct's config.json)
LLAMA_32_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
DEFAULT_OUT = Path.home() / ".cache" / "prefixgate-bench"


def hf_folder(out: Path) -> Path:
    """The random model as a Hugging Face folder (bfloat16 safetensors, ~2.5 GB)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.loading.source import resolve_model

    folder = out / "llama-3.2-1b-shape-random"
    if (folder / "model.safetensors").is_file():
        return folder
    # SmolLM2's, as transformers' own object: it is saved with the model for the converter
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path, local_files_only=True)
    config = LlamaConfig(
        **LLAMA_32_1B,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    t0 = time.monotonic()
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # padded ids never win a greedy pick (module docstring)
        model.model.embed_tokens.weight[len(tokenizer) :] = 0
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    print(f"random model saved in {time.monotonic() - t0:.0f} s: {folder}", flush=True)
    return folder


def convert(folder: Path, out: Path) -> Path:
    """llama.cpp's converter: the F16 GGUF."""
    f16 = out / "llama-3.2-1b-shape-random-f16.gguf"
    if not f16.is_file():
        tmp = f16.with_suffix(".tmp")
        cmd = [sys.executable, str(llama_converter()), str(folder), "--outtype", "f16"]
        subprocess.run([*cmd, "--outfile", str(tmp)], check=True)
        tmp.rename(f16)
    return f16


def quantize(f16: Path, kind: str, out: Path, threads: int) -> Path:
    """llama.cpp's quantizer, with its default per-tensor mix for `kind`."""
    target = out / f"llama-3.2-1b-shape-random-{kind.lower()}.gguf"
    if not target.is_file():
        tmp = target.with_suffix(".tmp")
        cmd = [str(llama_quantize()), str(f16), str(tmp), kind, str(threads)]
        subprocess.run(cmd, check=True)
        tmp.rename(target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build_llama_cpp(args.threads)
    gguf = quantize(convert(hf_folder(args.out), args.out), args.type, args.out, args.threads)
    print(gguf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
