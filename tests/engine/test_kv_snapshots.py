"""Registry KV snapshots across engine restarts: restored instead of prefilled, byte-identical
outputs, and every unusable snapshot (damaged, cut short, another model, another build,
another entry) recomputed with a log line that says why, leaking nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.kvcache import snapshot
from engine.kvcache.snapshot import read_blocks, read_header, write_snapshot
from engine.text.chat import chat_prompt_ids, text_prompt_ids
from tests.helpers import run_staggered

SYSTEM = "You are a helpful assistant. Answer the question briefly and politely."
DOC = "The quick brown fox jumps over the lazy dog. The scheduler admits new requests"
PREFIXES = f"""version: 1
prefixes:
  - name: sys
    messages:
      - role: system
        content: {SYSTEM}
  - name: doc
    text: "{DOC}"
"""
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture
def prefix_file(tmp_path: Path) -> Path:
    path = tmp_path / "prefixes.yaml"
    path.write_text(PREFIXES)
    return path


def _engine(model: Path, prefix_file: Path, snapshots: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "debug_check_integrity": True,
        "prefix_file": str(prefix_file),
        "kv_snapshot_dir": str(snapshots),
    }
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(**settings))
    if engine.snapshots is not None:
        assert engine.snapshots.flush(30)
    return engine


def _prompts(tokenizer: Any) -> list[list[int]]:
    doc = text_prompt_ids(tokenizer, DOC)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there!"}]
    return [
        chat_prompt_ids(tokenizer, chat),  # "sys" and a partial tail block
        doc,  # exactly "doc": served from its stored logits, no forward
        doc + text_prompt_ids(tokenizer, " and the pool"),  # "doc" and more
        text_prompt_ids(tokenizer, "Numbers like 0 1 2 3"),  # no registry hit
    ]


def _answers(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[Any, ...]]:
    """Every request's tokens, logprobs (bit for bit) and cached tokens, run together."""
    runs = run_staggered(engine, prompts, PARAMS, [0, 0, 1, 1])
    return [
        (
            [t for o in outs for t in o.token_ids],
            [(lp.token_id, lp.logprob, lp.top) for o in outs for lp in o.logprobs or []],
            outs[-1].num_cached_tokens,
        )
        for outs in runs
    ]


def _registry_logits(engine: LLMEngine) -> dict[str, torch.Tensor]:
    return {name: p.last_logits for name, p in engine.registry.prefixes.items()}


def _assert_idle(engine: LLMEngine) -> None:
    engine.check_integrity()
    pinned = engine.pool.num_pinned_blocks
    assert engine.pool.num_free_blocks + pinned == engine.pool.num_blocks
    assert pinned == sum(len(p.block_ids) for p in engine.registry.prefixes.values())


def test_a_restarted_engine_restores_its_prefixes_and_answers_byte_identically(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    assert first.snapshots is not None and first.snapshots.num_written == 2
    assert first.runner.num_forward_tokens > 0  # it filled them
    prompts = _prompts(tiny_tokenizer)
    expected = _answers(first, prompts)

    second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert second.snapshots is not None and second.snapshots.num_restored == 2
    assert second.runner.num_forward_tokens == 0  # nothing prefilled
    assert second.snapshots.num_written == 0  # nothing rewritten
    for name, logits in _registry_logits(first).items():
        assert torch.equal(_registry_logits(second)[name], logits)
    for name, prefix in first.registry.prefixes.items():  # the same K/V, bit for bit
        ids = second.registry.prefixes[name].block_ids
        assert torch.equal(
            second.runner.kv_cache.k_cache[:, ids],
            first.runner.kv_cache.k_cache[:, prefix.block_ids],
        )
    assert _answers(second, prompts) == expected
    assert [cached for *_, cached in expected][:3] == [
        first.registry.prefixes["sys"].num_tokens,
        len(prompts[1]),
        len(prompts[1]),
    ]
    _assert_idle(second)

    cold = _engine(tiny_llama_path, prefix_file, snapshots, enable_kv_snapshots=False)
    assert cold.snapshots is None and _answers(cold, prompts) == expected


def _snapshot_path(engine: LLMEngine, name: str) -> Path:
    assert engine.snapshots is not None
    return engine.snapshots.prefix_path(name)


def _flip_byte_in_first_block(path: Path) -> None:
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_offset + header.block_bytes // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_flip_byte_in_first_block, "block 0 of .* fails its checksum"),
        (_truncate, "truncated"),
        (_garbage, "bad magic"),
    ],
)
def test_a_damaged_snapshot_is_recomputed_and_rewritten(
    tiny_llama_path: Path,
    prefix_file: Path,
    tmp_path: Path,
    tiny_tokenizer: Any,
    caplog: pytest.LogCaptureFixture,
    damage: Any,
    why: str,
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    expected = _answers(first, _prompts(tiny_tokenizer))
    damage(_snapshot_path(first, "doc"))

    with caplog.at_level(logging.WARNING, logger="engine.kv_snapshots"):
        second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert second.snapshots is not None
    assert (second.snapshots.num_restored, second.snapshots.num_written) == (1, 1)
    [line] = [r.getMessage() for r in caplog.records if "'doc'" in r.getMessage()]
    assert "not used" in line and str(_snapshot_path(first, "doc")) in line
    assert pytest.importorskip("re").search(why, line), line
    _assert_idle(second)  # the blocks a failed read took went back
    assert _answers(second, _prompts(tiny_tokenizer)) == expected
    read_header(_snapshot_path(second, "doc"))  # whole again

    third = _engine(tiny_llama_path, prefix_file, snapshots)
    assert third.snapshots is not None and third.snapshots.num_restored == 2


def _rewrite_identity(engine: LLMEngine, path: Path, fact: str, value: str) -> None:
    """The same K/V re-filed as made by another model, build or version (`fact` = value)."""
    header = read_header(path)
    cache = engine.runner.kv_cache.k_cache
    k, v = (
        torch.zeros((cache.shape[0], header.num_blocks, *cache.shape[2:]), dtype=cache.dtype)
        for _ in "kv"
    )
    blocks = list(range(header.num_blocks))
    logits = read_blocks(path, header, k, v, blocks)
    write_snapshot(path, {**header.identity, fact: value}, header.meta, k, v, blocks, logits)


@pytest.mark.parametrize("fact", ["model_files", "weights", "compute_dtype", "kernels", "code"])
def test_a_snapshot_made_by_another_model_or_build_is_not_used(
    tiny_llama_path: Path,
    prefix_file: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fact: str,
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    assert first.snapshots is not None
    _rewrite_identity(first, _snapshot_path(first, "sys"), fact, "something else")
    with caplog.at_level(logging.WARNING, logger="engine.kv_snapshots"):
        second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert second.snapshots is not None and second.snapshots.num_restored == 1
    [line] = [r.getMessage() for r in caplog.records if "'sys'" in r.getMessage()]
    mine = first.snapshots.identity[fact]
    assert f"made with {fact} 'something else', this engine has {mine!r}" in line
    assert torch.equal(
        second.registry.prefixes["sys"].last_logits, first.registry.prefixes["sys"].last_logits
    )


def test_another_kv_dtype_is_not_used(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snapshots = tmp_path / "kv"
    _engine(tiny_llama_path, prefix_file, snapshots, kv_cache_dtype="float16")
    with caplog.at_level(logging.WARNING, logger="engine.kv_snapshots"):
        second = _engine(tiny_llama_path, prefix_file, snapshots, kv_cache_dtype="bfloat16")
    assert second.snapshots is not None and second.snapshots.num_restored == 0
    assert sum("made with kv_cache 'float16" in r.getMessage() for r in caplog.records) == 2


def test_a_changed_entry_is_prefilled_and_its_snapshot_replaced(
    tiny_llama_path: Path,
    prefix_file: Path,
    tmp_path: Path,
    tiny_tokenizer: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    snapshots = tmp_path / "kv"
    _engine(tiny_llama_path, prefix_file, snapshots)
    prefix_file.write_text(PREFIXES.replace("lazy dog", "sleepy cat"))
    with caplog.at_level(logging.INFO, logger="engine.kv_snapshots"):
        second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert second.snapshots is not None
    assert (second.snapshots.num_restored, second.snapshots.num_written) == (1, 1)
    assert any("'doc': the entry changed" in r.getMessage() for r in caplog.records)
    cold = _engine(tiny_llama_path, prefix_file, tmp_path / "none", enable_kv_snapshots=False)
    prompts = _prompts(tiny_tokenizer)
    assert _answers(second, prompts) == _answers(cold, prompts)
    third = _engine(tiny_llama_path, prefix_file, snapshots)
    assert third.snapshots is not None and third.snapshots.num_restored == 2


def test_a_reload_restores_a_known_entry_and_saves_a_new_one(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path
) -> None:
    snapshots = tmp_path / "kv"
    _engine(tiny_llama_path, prefix_file, snapshots)
    other = tmp_path / "other.yaml"
    other.write_text(PREFIXES.replace("name: doc", "name: doc2"))
    engine = _engine(tiny_llama_path, other, snapshots)  # sys restored, doc2 filled
    assert engine.snapshots is not None
    assert (engine.snapshots.num_restored, engine.snapshots.num_written) == (1, 1)
    engine.prefix_file.path = prefix_file  # back to doc: its snapshot is read at the reload
    before = engine.runner.num_forward_tokens
    engine.reload_prefix_file()
    while engine.prefixes.is_pending:
        engine.step()
    assert set(engine.registry.prefixes) == {"sys", "doc"}
    assert engine.snapshots.num_restored == 2 and engine.runner.num_forward_tokens == before
    _assert_idle(engine)


def test_snapshots_of_entries_no_longer_loaded_go_once_unused_for_a_week(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path
) -> None:
    """Entries removed or renamed leave their snapshots behind. After a load, the registry
    snapshots of entries it does not name go once unused for a week (another server on the
    folder may still use a recent one); a loaded entry's stays however old, and a restore
    marks it used."""
    snapshots = tmp_path / "kv"
    engine = _engine(tiny_llama_path, prefix_file, snapshots)  # sys and doc written
    assert engine.snapshots is not None
    folder = engine.snapshots.folder / "registry"
    week = 7 * 24 * 3600.0
    now = time.time()

    def aged(path: Path, days: float) -> Path:
        os.utime(path, (now - days * 86400, now - days * 86400))
        return path

    sys_path, doc_path = (engine.snapshots.prefix_path(n) for n in ("sys", "doc"))
    old = aged(shutil.copy(doc_path, folder / "gone-00000000.kv"), 8)
    recent = aged(shutil.copy(doc_path, folder / "renamed-00000000.kv"), 6)
    aged(sys_path, 30)
    aged(doc_path, 30)
    engine = _engine(tiny_llama_path, prefix_file, snapshots)  # restores both, then prunes
    assert engine.snapshots is not None and engine.snapshots.num_restored == 2
    assert engine.snapshots.flush(30)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (sys_path, doc_path, recent)
    )
    assert not old.exists()
    assert min(sys_path.stat().st_mtime, doc_path.stat().st_mtime) > now - week  # used now
    # A long-running server's entries, kept across a reload, read nothing: old, still kept.
    aged(sys_path, 30)
    aged(doc_path, 30)
    engine.reload_prefix_file()
    while engine.prefixes.is_pending:
        engine.step()
    assert engine.snapshots.flush(30)
    assert sys_path.exists() and doc_path.exists() and recent.exists()


def test_a_dead_writers_partial_file_is_removed_and_the_start_prefills(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    """What a kill -9 in the middle of a write leaves: a temporary of a dead process (the
    target is renamed into place only once whole)."""
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    expected = _answers(first, _prompts(tiny_tokenizer))
    path = _snapshot_path(first, "doc")
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    partial = path.with_name(f".tmp-{dead_pid}-{snapshot._HOST}-0badf00d-{path.name}")
    partial.write_bytes(path.read_bytes()[:100])
    path.unlink()
    second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert not partial.exists()
    assert second.snapshots is not None and second.snapshots.num_restored == 1
    assert _answers(second, _prompts(tiny_tokenizer)) == expected


# -- the hot automatic-cache set -------------------------------------------------------------------


def _ask(engine: LLMEngine, rid: str, prompt: list[int], scope: str | None) -> tuple[Any, ...]:
    """One request alone in cache scope `scope` (the gateway's cache_salt: a tenant's, or a
    request's own): its tokens, logprobs and cached tokens."""
    engine.add_prepared(rid, engine.prepare_request(prompt, PARAMS, cache_salt=scope))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return (
        [t for o in outputs for t in o.token_ids],
        [(lp.token_id, lp.logprob, lp.top) for o in outputs for lp in o.logprobs or []],
        outputs[-1].num_cached_tokens,
    )


def _texts(tokenizer: Any) -> list[list[int]]:
    """Three prompts of several blocks each that share no block."""
    return [
        text_prompt_ids(tokenizer, f"{word} numbers like 1 2 3 and letters a b c d e f g")
        for word in ("Alpha", "Bravo", "Charlie")
    ]


def test_the_hot_set_comes_back_after_a_graceful_stop_in_its_own_scopes_only(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    prompts = _texts(tiny_tokenizer)
    asks = list(enumerate(zip(prompts, ["t1", None, "t2"], strict=True)))
    cold = [_ask(first, f"a{i}", p, t) for i, (p, t) in asks]
    assert [cached for *_, cached in cold] == [0, 0, 0]
    warm = [_ask(first, f"b{i}", p, t) for i, (p, t) in asks]
    assert all(cached > 0 for *_, cached in warm)
    first.close()
    assert first.snapshots is not None and first.snapshots.hot_path.is_file()

    second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert second.snapshots is not None
    restored = second.pool.num_cached_blocks - sum(
        len(p.block_ids) for p in second.registry.prefixes.values()
    )
    assert restored > 0
    _assert_idle(second)
    # another scope (or none) finds nothing of t1's or t2's; each owner finds its own
    assert _ask(second, "x0", prompts[0], "t2")[2] == 0
    assert _ask(second, "x2", prompts[2], None)[2] == 0
    again = [_ask(second, f"c{i}", p, t) for i, (p, t) in asks]
    assert again == warm  # same tokens, logprobs and cached_tokens as before the restart
    assert [answer[:2] for answer in again] == [answer[:2] for answer in cold]


def test_the_hot_set_keeps_the_most_recent_blocks_within_its_budget(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots, kv_snapshot_budget=1)
    assert first.snapshots is not None
    block = first.snapshots.block_bytes
    first = _engine(tiny_llama_path, prefix_file, snapshots, kv_snapshot_budget=2 * block)
    old, recent, _ = _texts(tiny_tokenizer)
    _ask(first, "old", old, None)
    _ask(first, "recent", recent, None)
    first.close()
    second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert _ask(second, "old", old, None)[2] == 0
    assert _ask(second, "recent", recent, None)[2] == 2 * 4  # its first two blocks


def test_no_hot_set_is_written_when_the_engine_died(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    first = _engine(tiny_llama_path, prefix_file, tmp_path / "kv")
    _ask(first, "a", _texts(tiny_tokenizer)[0], None)
    first.close(graceful=False)
    assert first.snapshots is not None and not first.snapshots.hot_path.exists()


def test_a_damaged_hot_set_is_ignored_with_a_log_line(
    tiny_llama_path: Path,
    prefix_file: Path,
    tmp_path: Path,
    tiny_tokenizer: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    prompt = _texts(tiny_tokenizer)[0]
    expected = _ask(first, "a", prompt, None)
    first.close()
    assert first.snapshots is not None
    _flip_byte_in_first_block(first.snapshots.hot_path)
    with caplog.at_level(logging.WARNING, logger="engine.kv_snapshots"):
        second = _engine(tiny_llama_path, prefix_file, snapshots)
    assert any(
        "hot KV snapshot" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records
    )
    _assert_idle(second)
    assert _ask(second, "a", prompt, None) == expected  # computed again, from nothing


@pytest.mark.parametrize("budget", [-1, 1.5, "1GiB"])
def test_a_bad_budget_is_refused(budget: Any) -> None:
    with pytest.raises(InvalidRequestError, match="kv_snapshot_budget must be bytes >= 0"):
        EngineConfig(kv_snapshot_budget=budget)


def test_an_edited_model_config_is_not_restored(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The config decides every K's rotation (RoPE base and scaling) without touching the
    weight files: a snapshot made before an edit of config.json is not used after it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_path, model)
    snapshots = tmp_path / "kv"
    _engine(model, prefix_file, snapshots)
    config = json.loads((model / "config.json").read_text())
    rope = config.get("rope_parameters") or config
    rope["rope_theta"] = float(rope.get("rope_theta", 10000.0)) * 2
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="engine.kv_snapshots"):
        second = _engine(model, prefix_file, snapshots)
    assert second.snapshots is not None and second.snapshots.num_restored == 0
    assert sum("made with model_config" in r.getMessage() for r in caplog.records) == 2


def test_an_unusable_snapshot_folder_never_stops_a_start(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    """The folder is a file: nothing can be read or written there; the engine prefills,
    logs, and serves what it would serve without snapshots."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    engine = _engine(tiny_llama_path, prefix_file, blocked)
    assert engine.snapshots is not None and engine.snapshots.num_restored == 0
    cold = _engine(tiny_llama_path, prefix_file, tmp_path / "kv", enable_kv_snapshots=False)
    prompts = _prompts(tiny_tokenizer)
    assert _answers(engine, prompts) == _answers(cold, prompts)
    engine.close()  # the hot set cannot be written either: logged, and the stop finishes


def test_a_zero_budget_neither_restores_nor_keeps_a_hot_set(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    prompt = _texts(tiny_tokenizer)[0]
    _ask(first, "a", prompt, None)
    first.close()
    assert first.snapshots is not None and first.snapshots.hot_path.is_file()
    second = _engine(tiny_llama_path, prefix_file, snapshots, kv_snapshot_budget=0)
    assert _ask(second, "a", prompt, None)[2] == 0  # nothing was restored
    second.close()
    assert not first.snapshots.hot_path.exists()  # and the stale set is gone


def test_a_small_pool_restores_the_most_recent_part_of_the_hot_set(
    tiny_llama_path: Path, prefix_file: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    snapshots = tmp_path / "kv"
    first = _engine(tiny_llama_path, prefix_file, snapshots)
    words = re.findall(r"\w+", "Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliett")
    words += re.findall(r"\w+", "Kilo Lima Mike November Oscar Papa Quebec Romeo Sierra Tango")
    prompts = [
        text_prompt_ids(tiny_tokenizer, f"{w} numbers 1 2 3 and a b c d e f g") for w in words
    ]
    for i, prompt in enumerate(prompts):
        _ask(first, str(i), prompt, None)
    first.close()
    pinned = first.pool.num_pinned_blocks
    hot = len(first.pool.cached_by_recency())  # what the stop wrote
    free = 64 + 16  # a 256-token request's blocks and 16 more (the context is in the identity)
    assert hot > free
    second = _engine(tiny_llama_path, prefix_file, snapshots, num_kv_blocks=pinned + free)
    assert len(second.pool.cached_by_recency()) == free  # what the pool had free, not nothing
    _assert_idle(second)
    assert _ask(second, "newest", prompts[-1], None)[2] > 0  # the most recent came back
    assert _ask(second, "oldest", prompts[0], None)[2] == 0  # the least recent did not
