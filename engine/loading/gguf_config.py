"""Configs for the GGUF architectures transformers' GGUF reader refuses.

transformers rebuilds a config from a GGUF's metadata only for the architectures it lists. A
SmolLM3 file (llama.cpp's `smollm3`, what its converter writes for `SmolLM3ForCausalLM`) is
refused there, although it is a Llama whose every fourth layer skips RoPE: its config is read
here from the metadata keys llama.cpp's loader reads, the way transformers reads a `llama`
file's, plus what llama.cpp fixes by architecture rather than stores (the interval of the
layers without RoPE). The tokenizer needs no help: transformers builds it from the file's
`tokenizer.*` keys whatever the architecture (engine/loading/source.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.loading.gguf_header import read_header

# llama.cpp's src/models/smollm3.cpp: layer il skips RoPE where (il + 1) % 4 == 0; the file
# carries no key for it.
SMOLLM3_NO_ROPE_INTERVAL = 4

# GGUF architecture -> the Hugging Face model_type its config is built as here.
OWN_CONFIG_ARCHS = {"smollm3": "smollm3"}


def read_metadata(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The file's scalar and string metadata (arrays as their lengths) and its tensor names."""
    header = read_header(path)
    metadata = {**header.metadata, **header.array_lengths}
    return metadata, [tensor.name for tensor in header.tensors]


def config_dict(metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """The transformers config dict of a file of an `OWN_CONFIG_ARCHS` architecture.

    Every shape the file states is set, even where it equals the config class's default (a
    default is one checkpoint's value). KeyError where a key llama.cpp requires is missing."""
    arch = str(metadata["general.architecture"])
    if arch not in OWN_CONFIG_ARCHS:
        raise ValueError(f"no config reading for GGUF architecture {arch!r}")

    def key(name: str) -> Any:
        return metadata[f"{arch}.{name}"]

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    layers = int(key("block_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    config: dict[str, Any] = {
        "model_type": OWN_CONFIG_ARCHS[arch],
        "max_position_embeddings": int(key("context_length")),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        },
        # the vocabulary is the token list (the reader above gives arrays as their lengths)
        "vocab_size": int(metadata.get(f"{arch}.vocab_size", metadata["tokenizer.ggml.tokens"])),
        # llama.cpp's converter writes the head only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "smollm3":
        interval = SMOLLM3_NO_ROPE_INTERVAL
        config["no_rope_layer_interval"] = interval
        config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(layers)]
    return config
