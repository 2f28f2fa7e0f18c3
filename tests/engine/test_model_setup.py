"""engine.model_setup: the default KV pool size."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import EngineConfig, model_setup
from engine.model_setup import load_model


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
    with caplog.at_level(logging.INFO, logger="engine.model_setup"):
        loaded = load_model(_config(tiny_llama_path, max_num_seqs=3))
    assert loaded.pool.num_blocks == 3 * 64 // 4
    assert "max_num_seqs 3 x max_model_len 64" in caplog.text
    assert "not capped" in caplog.text


def test_the_default_pool_is_capped_by_memory(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probe = load_model(_config(tiny_llama_path, num_kv_blocks=16)).pool.spec.bytes_per_block
    monkeypatch.setattr(model_setup, "DEFAULT_CPU_KV_CAP", 40 * probe + probe // 2)
    with caplog.at_level(logging.INFO, logger="engine.model_setup"):
        loaded = load_model(_config(tiny_llama_path, max_num_seqs=1000))
    assert loaded.pool.num_blocks == 40
    assert ": capped" in caplog.text


def test_explicit_sizes_win(tiny_llama_path: Path) -> None:
    assert load_model(_config(tiny_llama_path, num_kv_blocks=17)).pool.num_blocks == 17
    probe = load_model(_config(tiny_llama_path, num_kv_blocks=16)).pool.spec.bytes_per_block
    memory = load_model(_config(tiny_llama_path, kv_cache_memory=20 * probe + 1))
    assert memory.pool.num_blocks == 20
