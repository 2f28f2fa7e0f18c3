"""The config cache: transformers' class once, then our JSON, and the engine's model the same
either way for every family it serves."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from engine.executor.models import MODEL_CLASSES, SUPPORTED_MODEL_TYPES
from engine.executor.models.layers import sliding_layers
from engine.loading.config_cache import cached_hf_config, cached_tokenizer

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
GPT2_SMALL = {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}

# Every family, and the config shapes whose derived fields matter: RoPE scaling (Llama 3's,
# LongRoPE's two factor sets), Gemma 3's layer types and per-kind RoPE, Qwen2's window.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("mistral", {"sliding_window": 32}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 3}),
    ("qwen3", {"head_dim": 32}),
    ("smollm3", {}),
    (
        "phi3",
        {
            "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 6,
                "long_factor": [2.0] * 6,
            },
        },
    ),
    ("gemma3_text", {"sliding_window": 32, "head_dim": 16, "query_pre_attn_scalar": 16}),
    ("gpt2", {}),
]


def _folder(tmp_path: Path, model_type: str, extra: dict[str, Any]) -> tuple[Path, Any]:
    sizes = GPT2_SMALL if model_type == "gpt2" else SMALL
    config = AutoConfig.for_model(model_type, **sizes, **extra)
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    return folder, AutoConfig.from_pretrained(folder, local_files_only=True)


def _model_state(config: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODEL_CLASSES[config.model_type](config, 128, torch.float32)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _in_a_fresh_process(code: str) -> list[str]:
    """What `code` prints, run where nothing is imported yet: the words of its output."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.split()


def test_every_family_the_engine_serves_is_covered() -> None:
    assert {model_type for model_type, _ in CASES} == SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize(("model_type", "extra"), CASES)
def test_the_cached_config_builds_the_same_model_as_transformers_own(
    tmp_path: Path, model_type: str, extra: dict[str, Any]
) -> None:
    folder, original = _folder(tmp_path, model_type, extra)
    cache = tmp_path / "cache"
    first = cached_hf_config(folder, cache)  # through AutoConfig, stored
    assert len(list((cache / "configs").glob("*.json"))) == 1
    again = cached_hf_config(folder, cache)  # from the JSON
    assert first.to_dict() == again.to_dict()
    assert again.model_type == model_type
    assert type(again).__name__ == type(original).__name__
    for key in original.to_dict():
        if key == "dtype":  # a torch dtype on one side, its name on the other
            continue
        assert getattr(again, key) == getattr(original, key), key
    for alias in original.attribute_map:  # GPT-2's n_embd as hidden_size, and the like
        assert getattr(again, alias) == getattr(original, alias), alias
    assert sliding_layers(again) == sliding_layers(original)
    # Our model from each: every parameter's shape, and every buffer (the RoPE tables
    # computed from the rope parameters) bit for bit.
    ours, theirs = _model_state(again), _model_state(original)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
        if name in dict(MODEL_CLASSES[model_type](original, 128, torch.float32).named_buffers()):
            assert torch.equal(ours[name], tensor), name


def test_a_warm_cache_reads_the_config_without_the_family_module(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path, "llama", {})
    cache = tmp_path / "cache"
    cached_hf_config(folder, cache)
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.loading.config_cache import cached_hf_config\n"
        f"config = cached_hf_config(Path({str(folder)!r}), Path({str(cache)!r}))\n"
        "print(config.model_type, config.hidden_size,\n"
        "      'transformers.models.llama.configuration_llama' in sys.modules)\n"
    )
    assert _in_a_fresh_process(probe) == ["llama", "64", "False"]


def test_a_changed_config_file_is_read_afresh(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path, "llama", {})
    cache = tmp_path / "cache"
    assert cached_hf_config(folder, cache).num_hidden_layers == 6
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 3}))
    assert cached_hf_config(folder, cache).num_hidden_layers == 3
    assert len(list((cache / "configs").glob("*.json"))) == 2


def test_a_broken_or_foreign_entry_is_read_afresh_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder, _ = _folder(tmp_path, "llama", {})
    cache = tmp_path / "cache"
    cached_hf_config(folder, cache)
    [entry] = (cache / "configs").glob("*.json")
    for damage in ("{ not json", json.dumps({"key": "another config's"})):
        entry.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
            assert cached_hf_config(folder, cache).hidden_size == 64
        assert f"cache entry {entry}" in caplog.text
        caplog.clear()
        assert json.loads(entry.read_text())["config"]["hidden_size"] == 64  # rewritten whole


def test_a_cache_that_cannot_be_written_still_gives_the_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder, _ = _folder(tmp_path, "llama", {})
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would be")
    with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
        assert cached_hf_config(folder, blocked).hidden_size == 64
    assert "cannot write the cache entry" in caplog.text


MESSAGES = [
    {"role": "system", "content": "Label the message."},
    {"role": "user", "content": "Hello <|im_start|> world, café 123!"},
]


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_gpt2_path", "smollm2_source"])
def test_the_remembered_tokenizer_class_tokenizes_as_auto_tokenizer_does(
    tmp_path: Path, request: pytest.FixtureRequest, fixture: str
) -> None:
    value = request.getfixturevalue(fixture)
    folder = value if isinstance(value, Path) else value.path
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cache = tmp_path / "cache"
    first = cached_tokenizer(folder, cache)  # through AutoTokenizer, its class stored
    again = cached_tokenizer(folder, cache)  # the stored class's own from_pretrained
    [entry] = (cache / "tokenizers").glob("*.json")
    assert json.loads(entry.read_text())["name"] == type(reference).__qualname__
    for tokenizer in (first, again):
        assert type(tokenizer) is type(reference)
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.all_special_tokens == reference.all_special_tokens
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
            reference.bos_token_id,
            reference.eos_token_id,
            reference.pad_token_id,
        )
        assert tokenizer.model_max_length == reference.model_max_length
        for text in ("Hello world", " leading space", MESSAGES[1]["content"], ""):
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], text
        if reference.chat_template:
            assert tokenizer.apply_chat_template(MESSAGES) == reference.apply_chat_template(
                MESSAGES
            )


def test_a_warm_tokenizer_cache_skips_the_family_module(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    cache = tmp_path / "cache"
    cached_tokenizer(tiny_llama_path, cache)
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.loading.config_cache import cached_tokenizer\n"
        f"tokenizer = cached_tokenizer(Path({str(tiny_llama_path)!r}), Path({str(cache)!r}))\n"
        "print(len(tokenizer) > 0,\n"
        "      'transformers.models.llama.configuration_llama' in sys.modules)\n"
    )
    assert _in_a_fresh_process(probe) == ["True", "False"]


def test_a_tokenizer_class_that_no_longer_imports_is_resolved_afresh(
    tmp_path: Path, tiny_llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    reference = cached_tokenizer(tiny_llama_path, cache)
    [entry] = (cache / "tokenizers").glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "name": "GoneTokenizer"}))
    with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
        tokenizer = cached_tokenizer(tiny_llama_path, cache)
    assert "not importable" in caplog.text
    assert type(tokenizer) is type(reference)
    assert json.loads(entry.read_text())["name"] == type(reference).__qualname__  # rewritten


def test_a_copy_of_the_model_elsewhere_shares_the_entry_and_keeps_its_own_path(
    tmp_path: Path,
) -> None:
    folder, _ = _folder(tmp_path, "llama", {})
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_bytes((folder / "config.json").read_bytes())
    cache = tmp_path / "cache"
    assert cached_hf_config(folder, cache).name_or_path == str(folder)
    assert cached_hf_config(copy, cache).name_or_path == str(copy)
    assert len(list((cache / "configs").glob("*.json"))) == 1
