"""engine.loading.setup: the default KV pool size; the quantized-weights cache."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.core.config import default_cache_dir
from engine.core.errors import ModelLoadError
from engine.core.memory import huge_page_bytes, huge_pages_available, transparent_huge_pages
from engine.executor.kernels import NOT_BUILT, KernelBuild, build_cpu_kernels
from engine.executor.quantization import QuantizedLinear, WeightFormat
from engine.loading import quantized_cache
from engine.loading import setup as model_setup
from engine.loading.build import kernel_weights
from engine.loading.setup import load_model
from engine.loading.source import ModelSource, resolve_model
from engine.text.chat import chat_prompt_ids


def _config(model: Path, **overrides: object) -> EngineConfig:
    settings: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": 4,
        "max_model_len": 64,
    }
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


def test_the_default_pool_holds_max_num_seqs_full_length_sequences(
    tiny_llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.loading.setup"):
        loaded = load_model(_config(tiny_llama_path, max_num_seqs=3))
    assert loaded.pool.num_blocks == 3 * 64 // 4
    assert "max_num_seqs 3 x max_model_len 64" in caplog.text
    assert "not capped" in caplog.text


def test_the_default_pool_is_capped_by_memory(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probe = load_model(_config(tiny_llama_path, num_kv_blocks=16)).pool.spec.bytes_per_block
    monkeypatch.setattr(model_setup, "DEFAULT_CPU_KV_CAP", 40 * probe + probe // 2)
    with caplog.at_level(logging.INFO, logger="engine.loading.setup"):
        loaded = load_model(_config(tiny_llama_path, max_num_seqs=1000))
    assert loaded.pool.num_blocks == 40
    assert ": capped" in caplog.text


def test_a_model_limit_the_pool_cannot_hold_is_served_at_the_pools_size(
    tiny_llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without --max-model-len the model's own limit (the tiny one's 512; Llama 3.2's 131072)
    is what a sequence may reach: a pool that holds less (40 blocks of 4 here) serves half
    its size (room for pinned prefixes and other sequences), with a warning, and the RoPE
    tables are built for that; asked for explicitly, the same length is an error that says
    what to change."""
    with caplog.at_level(logging.WARNING, logger="engine.loading.setup"):
        loaded = load_model(_config(tiny_llama_path, max_model_len=None, num_kv_blocks=40))
    assert loaded.max_model_len == 80
    assert loaded.model.rotary.cos.shape[0] == 80  # type: ignore[attr-defined]
    assert "max_model_len 512 (the model's limit) is more than the KV cache holds" in caplog.text
    with pytest.raises(ModelLoadError, match="raise --kv-cache-memory or lower --max-model-len"):
        load_model(_config(tiny_llama_path, max_model_len=512, num_kv_blocks=40))


def test_default_template_variables_reach_the_tokenizer_and_bad_ones_fail_the_start(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--default-chat-template-kwargs` is the tokenizer's defaults; a value that is not a
    JSON object of free names fails the start, before the model is read."""
    config = _config(tiny_llama_path, default_chat_template_kwargs='{"enable_thinking": false}')
    assert load_model(config).tokenizer.template_defaults == {"enable_thinking": False}
    assert load_model(_config(tiny_llama_path)).tokenizer.template_defaults == {}

    def never(model: str | None) -> None:
        raise AssertionError("the model was read before the flag was checked")

    monkeypatch.setattr("engine.loading.setup.resolve_model", never)
    for text, reason in (("off", "not JSON"), ('{"tools": []}', "'tools': the server sets it")):
        config = _config(tiny_llama_path, default_chat_template_kwargs=text)
        with pytest.raises(ModelLoadError, match=f"--default-chat-template-kwargs: {reason}"):
            load_model(config)


def test_explicit_sizes_win(tiny_llama_path: Path) -> None:
    assert load_model(_config(tiny_llama_path, num_kv_blocks=17)).pool.num_blocks == 17
    probe = load_model(_config(tiny_llama_path, num_kv_blocks=16)).pool.spec.bytes_per_block
    memory = load_model(_config(tiny_llama_path, kv_cache_memory=20 * probe + 1))
    assert memory.pool.num_blocks == 20


def test_quantized_weights_are_cached_and_restored_exactly(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first start quantizes and writes the cache; the second reads it (no float weights)
    and computes the same thing, on the quantized kernel; a damaged cache file is ignored and
    written again."""
    kernels_dir = default_cache_dir()  # built once for the whole run, not in tmp_path
    monkeypatch.setattr(
        model_setup, "build_cpu_kernels", lambda _dir: build_cpu_kernels(kernels_dir)
    )
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))
    config = _config(tiny_llama_path, quantization="int4")
    first = load_model(config)
    [cached] = (tmp_path / "quantized").glob("*.safetensors")
    read_float_weights = model_setup.load_float_weights
    monkeypatch.setattr(model_setup, "load_float_weights", _never)
    second = load_model(config)
    assert _weights(second.model) == _weights(first.model)
    assert len(_quantized(second.model)) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down), head
    assert all(m.dense is None for m in _quantized(second.model))  # one path: the kernel
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for a, b in zip(_quantized(first.model), _quantized(second.model), strict=True):
            for num_rows in (1, 17):
                x = torch.randn(num_rows, a.quantized.in_features, generator=gen)
                assert torch.equal(a(x), b(x))
    cached.write_bytes(cached.read_bytes()[:100])  # truncated
    monkeypatch.setattr(model_setup, "load_float_weights", read_float_weights)

    with caplog.at_level(logging.WARNING):
        third = load_model(config)
    assert "ignoring the quantized cache" in caplog.text
    assert _weights(third.model) == _weights(first.model)
    assert cached.stat().st_size > 100  # written again


def test_the_kernels_weights_lie_on_huge_pages_from_either_start(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights a decode step streams, in one mapping of 2 MB pages: moved there after the
    first start quantizes them, read straight into one from the cache on the second; where
    huge pages are off, left where loading put them; and not where linears run on dense
    copies (packing replaces those, and an arena would keep their pages)."""
    if not huge_pages_available():
        pytest.skip(f"transparent huge pages: {transparent_huge_pages() or 'none'}")
    kernels_dir = default_cache_dir()
    monkeypatch.setattr(
        model_setup, "build_cpu_kernels", lambda _dir: build_cpu_kernels(kernels_dir)
    )
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))
    config = _config(tiny_llama_path, quantization="int4")
    for start in ("quantized", "cached"):
        weights = kernel_weights(load_model(config).model)
        assert len({t.untyped_storage().data_ptr() for t in weights}) == 1, start
        assert huge_page_bytes(weights) >= sum(t.nbytes for t in weights), start
    monkeypatch.setattr(model_setup.quantized_cache, "huge_pages_available", lambda: False)
    weights = kernel_weights(load_model(config).model)
    assert len({t.untyped_storage().data_ptr() for t in weights}) == len(weights)
    monkeypatch.undo()
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path / "dense"))
    dense = _config(tiny_llama_path, quantization="int4", enable_compile=False)
    for _start in ("quantized", "cached"):
        linears = _quantized(load_model(dense).model)
        assert linears and all(m.dense is not None for m in linears)
        tensors = [t for m in linears for part in m.parts for t in part.tensors()]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)


def _never(path: Path, *args: object) -> dict[str, torch.Tensor]:
    raise AssertionError(f"{path} was read")


def _quantized(model: object) -> list[QuantizedLinear]:
    assert isinstance(model, torch.nn.Module)
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def _weights(model: object) -> list[tuple[str, bytes]]:
    """Every quantized weight's bytes and every parameter's, by name: equal means the same
    model."""
    assert isinstance(model, torch.nn.Module)
    quantized = [
        (str(i), bytes(q.codes.numpy()) + bytes(q.scales.view(torch.uint8).numpy()))
        for i, q in enumerate(part for m in _quantized(model) for part in m.parts)
    ]
    params = [
        (n, bytes(t.detach().contiguous().view(torch.uint8).numpy()))
        for n, t in model.state_dict().items()
    ]
    return quantized + params


def test_without_the_kernels_quantized_linears_run_on_their_dense_copies(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))
    loaded = load_model(_config(tiny_llama_path, quantization="int4", enable_compile=False))
    assert not loaded.has_cpu_kernels
    assert all(m.dense is not None for m in _quantized(loaded.model))


@pytest.mark.e2e
def test_a_gguf_models_first_start_reads_its_blocks_not_float_weights(
    smollm2_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no quantized cache, the embedded model is built from the GGUF's own Q4_1 / Q8_0
    blocks (engine/loading/gguf.py), never from float weights, and cached; the second start
    reads that cache and builds the same model, without reading the file's blocks."""
    monkeypatch.setattr(quantized_cache, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(model_setup, "load_float_weights", _never)
    config = EngineConfig(max_model_len=256, kv_cache_memory=64 << 20)
    first = load_model(config)
    assert [p.parent for p in (tmp_path / "quantized").glob("*.safetensors")] == [
        tmp_path / "quantized"
    ]
    monkeypatch.setattr(model_setup, "direct_gguf", _never)
    second = load_model(config)
    assert _weights(second.model) == _weights(first.model)
    assert len(_quantized(first.model)) == 4 * 30 + 1  # qkv, o, gate_up, down per layer; head


def test_a_models_stale_quantized_caches_are_removed_when_a_new_one_is_written(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layout-code or torch upgrade keys a new cache file: writing one removes the same
    model's others that are unused for a week, past the two most recently used; a read marks
    its file used. Other models' files, and files of another shape, are left alone."""
    monkeypatch.setattr(quantized_cache, "default_cache_dir", lambda: tmp_path)
    folder = tmp_path / "quantized"
    folder.mkdir()
    now = time.time()

    def made(key: str, days: float, model: str = tiny_llama_path.name) -> Path:
        path = folder / f"{model}-{key}.safetensors"
        path.write_bytes(b"x")
        os.utime(path, (now - days * 86400, now - days * 86400))
        return path

    recent, stale = made("a" * 16, 1), made("b" * 16, 10)  # the two most recent: both kept
    gone = [made("c" * 16, 11), made("d" * 16, 30)]
    others = {made("f" * 16, 40, "other"), made("notes", 40)}
    config = _config(tiny_llama_path, quantization="int4")
    load_model(config)
    [written] = set(folder.iterdir()) - {recent, stale, *gone, *others}
    assert set(folder.iterdir()) == {recent, stale, written, *others}
    os.utime(written, (now - 9 * 86400, now - 9 * 86400))
    load_model(config)  # read from the cache, which marks it used
    assert written.stat().st_mtime > now - 60
    # past the two most recent, a file used within the week stays
    written.unlink()
    second, third = made("e" * 16, 2), made("0" * 16, 3)
    load_model(config)
    assert set(folder.iterdir()) == {recent, second, third, written, *others}


def test_a_failed_kernel_build_serves_on_the_torch_paths(
    tiny_llama_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No working C++ compiler: the engine still starts, keeps the quantized linears' dense
    copies, says so in its start-up line and stats, and answers what the engine without
    kernels (`--no-compile`) answers."""
    from engine import LLMEngine, SamplingParams

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PREFIXGATE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    config = _config(tiny_llama_path, quantization="int4")
    with caplog.at_level(logging.INFO, logger="engine.loading.setup"):
        loaded = load_model(config)
    assert (loaded.kernels.is_built, loaded.has_cpu_kernels) == (False, False)
    assert all(m.dense is not None for m in _quantized(loaded.model))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model ")]
    assert "no C++ kernels, torch paths (RuntimeError: Error building extension" in line

    engine = LLMEngine(config, loaded)
    assert engine.stats().cpu_kernels == "off"
    reference = LLMEngine(_config(tiny_llama_path, quantization="int4", enable_compile=False))
    assert reference.stats().cpu_kernels == "off"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 2, 7], [3, 3, 8]]
    assert engine.generate(prompts, params) == reference.generate(prompts, params)


TURNS = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def test_a_chat_template_file_replaces_the_models_own(
    tiny_llama_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template = tmp_path / "turns.jinja"
    template.write_text(TURNS, encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="engine.loading.setup"):
        own = load_model(_config(tiny_llama_path, num_kv_blocks=16))
        given = load_model(_config(tiny_llama_path, num_kv_blocks=16, chat_template=str(template)))
    assert "chat template: the model's own" in caplog.text
    assert f"chat template: from {template}" in caplog.text
    messages = [{"role": "user", "content": "Hi"}]
    rendered = given.tokenizer.decode(chat_prompt_ids(given.tokenizer, messages))
    assert rendered == "[user] Hi\n[assistant]"
    assert own.tokenizer.chat_template != TURNS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read the chat template"),
        ("{% for m in messages %}{{ m.content }}", r"not valid Jinja \(line 1\)"),
    ],
)
def test_a_chat_template_that_cannot_serve_fails_the_start(
    tiny_llama_path: Path, tmp_path: Path, text: str | None, message: str
) -> None:
    template = tmp_path / "broken.jinja"
    if text is not None:
        template.write_text(text, encoding="utf-8")
    config = _config(tiny_llama_path, num_kv_blocks=16, chat_template=str(template))
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(config)
    assert str(template) in str(info.value)


def test_the_quantized_cache_key_follows_the_layout_code(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written by other packing code is another file: a layout changed without a
    version bump is never read as the new one."""
    layout = tmp_path / "layout.py"
    layout.write_text("LAYOUT = 1\n")
    monkeypatch.setattr(quantized_cache, "_LAYOUT_SOURCES", (str(layout),))
    source = resolve_model(str(tiny_llama_path))
    weights = WeightFormat(layers="int4", head="int8")
    before = quantized_cache.cache_file(source, weights, torch.float32)
    assert quantized_cache.cache_file(source, weights, torch.float32) == before
    layout.write_text("LAYOUT = 2\n")
    assert quantized_cache.cache_file(source, weights, torch.float32) != before


def test_the_kernels_build_while_the_model_is_resolved(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start compiles the kernels (about a minute) while the model is resolved (a
    GGUF's conversion: seconds to a minute), not after: each side here waits for the other
    to have begun."""
    building, resolved = threading.Event(), threading.Event()
    build, resolve = model_setup.build_cpu_kernels, model_setup.resolve_model

    def build_while_resolving(cache_dir: Path) -> KernelBuild:
        building.set()
        assert resolved.wait(timeout=20), "the model was not resolved while the kernels built"
        return build(cache_dir)

    def resolve_while_building(spec: str | None) -> ModelSource:
        assert building.wait(timeout=20), "the kernels were not building"
        source = resolve(spec)
        resolved.set()
        return source

    monkeypatch.setattr(model_setup, "build_cpu_kernels", build_while_resolving)
    monkeypatch.setattr(model_setup, "resolve_model", resolve_while_building)
    assert load_model(_config(tiny_llama_path)).has_cpu_kernels


def test_a_start_that_fails_does_not_wait_for_the_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that cannot be served fails the start at once, the compiler still running."""
    release = threading.Event()

    def never_done(cache_dir: Path) -> KernelBuild:
        release.wait(timeout=60)
        return NOT_BUILT

    monkeypatch.setattr(model_setup, "build_cpu_kernels", never_done)
    try:
        with pytest.raises(ModelLoadError, match="does not exist"):
            load_model(_config(tmp_path / "nowhere"))
    finally:
        release.set()
