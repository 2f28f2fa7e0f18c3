"""The config cache: transformers' classes once, then our own files, and the engine's model
and tokenizer the same either way for every family it serves."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import shutil
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
from engine.text.tokenizer import Tokenizer
from tests.engine.text.test_chat_template import TOOLS

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
    assert again.class_name == type(original).__name__
    for key in original.to_dict():
        if key == "dtype":  # a torch dtype on one side, its name on the other
            continue
        # As JSON holds them: id2label's int keys are strings, tuples lists.
        expected = json.loads(json.dumps(getattr(original, key)))
        assert getattr(again, key) == expected, key
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


TEXTS = (
    "Hello world",
    " leading space",
    MESSAGES[1]["content"],
    "a .b ?c don 't ",
    "日本語 🚀",
    "",
)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_gpt2_path", "smollm2_source"])
def test_the_cached_tokenizer_works_as_auto_tokenizers_own(
    tmp_path: Path, request: pytest.FixtureRequest, fixture: str
) -> None:
    value = request.getfixturevalue(fixture)
    folder = value if isinstance(value, Path) else value.path
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cache = tmp_path / "cache"
    first = cached_tokenizer(folder, cache)  # through AutoTokenizer, stored
    again = cached_tokenizer(folder, cache)  # read back, without transformers
    assert len(list((cache / "tokenizers").iterdir())) == 1
    for tokenizer in (first, again):
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.get_added_vocab() == reference.get_added_vocab()
        assert len(tokenizer) == len(reference)
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.all_special_ids == reference.all_special_ids
        assert tokenizer.special_tokens_map == reference.special_tokens_map
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            reference.bos_token_id,
            reference.eos_token_id,
        )
        ids = list(range(min(len(reference), 400)))
        assert tokenizer.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        for text in TEXTS:
            for add, split in ((True, False), (False, False), (False, True)):
                expected = reference(text, add_special_tokens=add, split_special_tokens=split)
                assert (
                    tokenizer.encode(text, add_special_tokens=add, split_special_tokens=split)
                    == expected["input_ids"]
                ), (text, add, split)
            # an echoed prompt's offsets: the same ids, each token where transformers maps it
            mapped = reference(text, return_offsets_mapping=True)
            spans = mapped["offset_mapping"]
            with_offsets = tokenizer.encode_with_offsets(text)
            assert with_offsets.ids == mapped["input_ids"]
            starts = [at for at, (a, b) in zip(with_offsets.starts, spans, strict=True) if b > a]
            assert starts == [a for a, b in spans if b > a]
            encoded = reference(text)["input_ids"]
            for skip in (False, True):
                assert tokenizer.decode(encoded, skip_special_tokens=skip) == reference.decode(
                    encoded, skip_special_tokens=skip
                ), (text, skip)
        if reference.chat_template:
            for tools in (None, TOOLS):
                for add_generation_prompt in (False, True):
                    assert tokenizer.apply_chat_template(
                        MESSAGES, tools=tools, add_generation_prompt=add_generation_prompt
                    ) == reference.apply_chat_template(
                        MESSAGES,
                        tools=tools,
                        add_generation_prompt=add_generation_prompt,
                        tokenize=False,
                    )


def test_a_warm_cache_loads_config_and_tokenizer_without_transformers(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    cache = tmp_path / "cache"
    cached_hf_config(tiny_llama_path, cache)
    cached_tokenizer(tiny_llama_path, cache)
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.loading.config_cache import cached_hf_config, cached_tokenizer\n"
        f"folder, cache = Path({str(tiny_llama_path)!r}), Path({str(cache)!r})\n"
        "config = cached_hf_config(folder, cache)\n"
        "tokenizer = cached_tokenizer(folder, cache)\n"
        "print(config.hidden_size, len(tokenizer.encode('hello world')) > 0,\n"
        "      'transformers' in sys.modules)\n"
    )
    assert _in_a_fresh_process(probe) == ["64", "True", "False"]


@pytest.mark.parametrize("damage", ["tokenizer.json", "tokenizer_facts.json"])
def test_a_damaged_tokenizer_entry_is_built_afresh_with_a_warning(
    tmp_path: Path, tiny_llama_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cache = tmp_path / "cache"
    reference = cached_tokenizer(tiny_llama_path, cache)
    [entry] = (cache / "tokenizers").iterdir()
    (entry / damage).write_text('{"truncated": ')
    with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
        tokenizer = cached_tokenizer(tiny_llama_path, cache)
    assert f"cache entry {entry} unreadable" in caplog.text
    assert tokenizer.get_vocab() == reference.get_vocab()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
        cached_tokenizer(tiny_llama_path, cache)  # rewritten whole: read without a warning
    assert caplog.text == ""


def test_a_changed_tokenizer_file_is_a_new_entry(tmp_path: Path, tiny_llama_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_path, folder)
    cache = tmp_path / "cache"
    assert cached_tokenizer(folder, cache).chat_template
    (folder / "chat_template.jinja").write_text("{{ 1 }}")
    assert cached_tokenizer(folder, cache).chat_template == "{{ 1 }}"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["split_special_tokens"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    text = "a <|im_end|> b"
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert reference(text)["input_ids"] != reference(text, split_special_tokens=False)["input_ids"]
    assert cached_tokenizer(folder, cache).encode(text) == reference(text)["input_ids"]
    assert len(list((cache / "tokenizers").iterdir())) == 3


def test_a_tokenizer_entry_that_cannot_be_written_is_a_warning(
    tmp_path: Path,
    tiny_llama_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Rust tokenizer's save raises a bare Exception (a full disk: os error 28)."""

    def full_disk(self: Tokenizer, folder: Path) -> None:
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(Tokenizer, "save", full_disk)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="engine.loading.config_cache"):
        tokenizer = cached_tokenizer(tiny_llama_path, cache)
    assert "cannot write the cache entry" in caplog.text and "os error 28" in caplog.text
    assert tokenizer.encode("hello") and list((cache / "tokenizers").iterdir()) == []


def test_config_and_tokenizer_survive_copy_and_pickle(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    """Ray pickles the tokenizer to the ingress; transformers' configs could be copied."""
    cache = tmp_path / "cache"
    config = cached_hf_config(tiny_llama_path, cache)
    for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert copied.to_dict() == config.to_dict() and copied.hidden_size == 64
    tokenizer = cached_tokenizer(tiny_llama_path, cache)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    copied_tokenizer = pickle.loads(pickle.dumps(tokenizer))
    text = "a <|im_end|> b"
    for split in (False, True):
        assert copied_tokenizer.encode(text, split_special_tokens=split) == tokenizer.encode(
            text, split_special_tokens=split
        )
    assert copied_tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


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
