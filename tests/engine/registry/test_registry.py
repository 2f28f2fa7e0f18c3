"""Prefix registry inside the engine: sharing, exact hits, dedup, reload, accounting.

Every scenario checks output equality against caching off (and transformers), and the exact
holder accounting (`check_integrity`: each block's ref_cnt == its number of holders).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from engine.registry.loader import PrefixBudgetError
from engine.registry.registry import registry_digest
from engine.registry.spec import PrefixSpec, RegistryFileError
from engine.text.chat import chat_prompt_ids, text_prompt_ids
from tests.helpers import run_staggered, tokens_of

BLOCK = 4
SYSTEM = "You are a helpful assistant. Answer the question briefly and politely."
DOC = "The quick brown fox jumps over the lazy dog. The scheduler admits new requests"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Hello there!", "How are you today?"]


def _yaml(entries: str) -> str:
    return "version: 1\nprefixes:\n" + entries


SYS_ENTRY = f"""  - name: sys
    messages:
      - role: system
        content: {SYSTEM}
"""
DOC_ENTRY = f"""  - name: doc
    text: "{DOC}"
"""


@pytest.fixture
def prefix_file(tmp_path: Path) -> Path:
    path = tmp_path / "prefixes.yaml"
    path.write_text(_yaml(SYS_ENTRY + DOC_ENTRY))
    return path


def _engine(model: Path, prefix_file: Path | None, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK,
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "debug_check_integrity": True,
        "prefix_file": str(prefix_file) if prefix_file else None,
        # The registry alone, so that counts are exact: the automatic cache would also serve
        # these prompts' repeated parts (tests/engine/test_auto_prefix_cache.py).
        "enable_auto_prefix_cache": False,
    }
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _chat(tokenizer: Any, question: str) -> list[int]:
    return chat_prompt_ids(
        tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    )


def _hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _assert_idle(engine: LLMEngine) -> None:
    """No leak: only the registry holds blocks, each pinned, once."""
    engine.check_integrity()
    pinned = engine.pool.num_pinned_blocks
    assert engine.pool.num_free_blocks + pinned == engine.pool.num_blocks
    assert pinned == sum(len(p.block_ids) for p in engine.registry.prefixes.values())


@pytest.fixture
def prompts(tiny_tokenizer: Any) -> list[list[int]]:
    doc_ids = text_prompt_ids(tiny_tokenizer, DOC)
    return [
        _chat(tiny_tokenizer, QUESTIONS[0]),  # hits "sys" (partial tail)
        text_prompt_ids(tiny_tokenizer, "Numbers like 0 1 2 3 4 5"),  # no match
        doc_ids,  # exact hit on "doc": no forward at all
        _chat(tiny_tokenizer, QUESTIONS[1]),  # hits "sys"
        doc_ids + text_prompt_ids(tiny_tokenizer, " and the pool"),  # hits "doc"
    ]


def test_startup_registers_each_prefix_with_pinned_blocks(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    sys_prefix, doc_prefix = engine.registry.prefixes["sys"], engine.registry.prefixes["doc"]
    assert list(sys_prefix.token_ids) == _chat(tiny_tokenizer, "x")[: sys_prefix.num_tokens]
    assert list(doc_prefix.token_ids) == text_prompt_ids(tiny_tokenizer, DOC)
    for prefix in (sys_prefix, doc_prefix):
        assert len(prefix.block_ids) == -(-prefix.num_tokens // BLOCK)
        assert all(
            engine.pool.is_pinned(b) and engine.pool.ref_cnt[b] == 1 for b in prefix.block_ids
        )
    assert engine.registry.last_reload.ok is True
    _assert_idle(engine)


def test_hits_equal_caching_off_and_transformers_at_batch_1(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]]
) -> None:
    cached = _engine(tiny_llama_path, prefix_file)
    plain = _engine(tiny_llama_path, None)
    for prompt in prompts:
        expected = _hf_greedy(tiny_llama_path, prompt, 8)
        assert plain.generate([prompt], GREEDY) == [expected]
        assert cached.generate([prompt], GREEDY) == [expected]
    assert cached.registry.stats.num_lookups == 5
    assert cached.registry.stats.num_hits == 4
    _assert_idle(cached)


@pytest.mark.parametrize("budget", [64, 5])
def test_hits_equal_caching_off_in_mixed_continuous_batches(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]], budget: int
) -> None:
    arrivals = [0, 0, 1, 1, 3]
    cached = _engine(tiny_llama_path, prefix_file, max_num_batched_tokens=budget)
    plain = _engine(tiny_llama_path, None, max_num_batched_tokens=budget)
    got = run_staggered(cached, prompts, GREEDY, arrivals)
    want = run_staggered(plain, prompts, GREEDY, arrivals)
    assert [tokens_of(r) for r in got] == [tokens_of(r) for r in want]
    sys_len = cached.registry.prefixes["sys"].num_tokens
    doc_len = cached.registry.prefixes["doc"].num_tokens
    assert [r[-1].num_cached_tokens for r in got] == [sys_len, 0, doc_len, sys_len, doc_len]
    assert [r[-1].num_cached_tokens for r in want] == [0] * 5
    _assert_idle(cached)


def test_hits_survive_preemption(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # One token a step, so that this pool runs out mid-decode (drafts finish these
    # sequences in fewer steps; tests/engine/speculative/ preempts with drafts)
    small = _engine(
        tiny_llama_path, prefix_file, num_kv_blocks=60, max_model_len=96, speculative="off"
    )
    plain = _engine(tiny_llama_path, None, num_kv_blocks=60, max_model_len=96, speculative="off")
    got = run_staggered(small, prompts, params, [0, 0, 0, 0, 0])
    want = run_staggered(plain, prompts, params, [0, 0, 0, 0, 0])
    assert small.scheduler.num_preemptions > 0
    assert [tokens_of(r) for r in got] == [tokens_of(r) for r in want]
    _assert_idle(small)


def test_shared_blocks_and_private_tail(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    prefix = engine.registry.prefixes["sys"]
    assert prefix.is_tail_partial
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[3], GREEDY)
    engine.step()
    full = prefix.block_ids[: prefix.num_full_blocks]
    tables = [engine.scheduler.find(r).block_table for r in ("a", "b")]  # type: ignore[union-attr]
    for table in tables:
        assert table[: len(full)] == full  # zero copy: the very same blocks
        assert table[len(full)] not in prefix.block_ids  # the partial tail is a private copy
    assert [engine.pool.ref_cnt[b] for b in full] == [3] * len(full)  # registry + 2 requests
    assert engine.pool.ref_cnt[prefix.block_ids[-1]] == 1
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.pool.ref_cnt[b] for b in prefix.block_ids] == [1] * len(prefix.block_ids)
    _assert_idle(engine)


def test_block_aligned_prefix_shares_every_block(
    tiny_llama_path: Path, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    ids = text_prompt_ids(tiny_tokenizer, DOC)
    aligned_text = tiny_tokenizer.decode(ids[: len(ids) // BLOCK * BLOCK])
    assert len(text_prompt_ids(tiny_tokenizer, aligned_text)) % BLOCK == 0
    path = tmp_path / "aligned.yaml"
    path.write_text(_yaml(f'  - name: aligned\n    text: "{aligned_text}"\n'))
    engine = _engine(tiny_llama_path, path)
    prefix = engine.registry.prefixes["aligned"]
    assert not prefix.is_tail_partial
    prompt = text_prompt_ids(tiny_tokenizer, aligned_text + " and the pool")
    assert prompt[: prefix.num_tokens] == list(prefix.token_ids)
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    table = engine.scheduler.find("a").block_table  # type: ignore[union-attr]
    assert table[: len(prefix.block_ids)] == prefix.block_ids
    assert [engine.pool.ref_cnt[b] for b in prefix.block_ids] == [2] * len(prefix.block_ids)
    while engine.has_unfinished_requests():
        engine.step()
    plain = _engine(tiny_llama_path, None)
    assert engine.generate([prompt], GREEDY) == plain.generate([prompt], GREEDY)
    _assert_idle(engine)


def test_exact_hit_runs_no_forward(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    before = engine.runner.num_forward_tokens
    engine.add_request("exact", prompts[2], GREEDY)
    engine.step()  # first token sampled from the stored logits
    assert engine.runner.num_forward_tokens == before
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.num_forward_tokens == before + GREEDY.max_tokens - 1  # decodes only


def test_equal_ids_from_different_text_hit(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    as_text = text_prompt_ids(tiny_tokenizer, rendered)  # a completion with the chat's text
    assert as_text == _chat(tiny_tokenizer, "Hi")
    [outputs] = run_staggered(engine, [as_text], GREEDY, [0])
    assert outputs[-1].num_cached_tokens == engine.registry.prefixes["sys"].num_tokens


def test_identical_prompts_admitted_together_are_prefilled_once(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, None)
    prompt = prompts[1]
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1))
    one = engine.runner.num_forward_tokens
    engine.step()
    one_prefill = engine.runner.num_forward_tokens - one
    assert one_prefill == len(prompt)
    start = engine.runner.num_forward_tokens
    params = SamplingParams(temperature=0, max_tokens=1)
    results = engine.generate([prompt] * 4, params)
    assert engine.runner.num_forward_tokens - start == one_prefill  # one prefill for all four
    assert results == [results[0]] * 4
    _assert_idle(engine)


def test_duplicates_decode_independently_after_sharing(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, None)
    greedy = engine.generate([prompts[1]] * 3, GREEDY)
    assert (
        greedy
        == [
            _engine(tiny_llama_path, None, enable_prefix_cache=False).generate(
                [prompts[1]], GREEDY
            )[0]
        ]
        * 3
    )
    seeded = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2)
    ]
    for request_id, params in zip(("s1", "s2"), seeded, strict=True):
        engine.add_request(request_id, prompts[1], params)
    outs: dict[str, list[int]] = {"s1": [], "s2": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.token_ids
    assert outs["s1"] != outs["s2"]
    _assert_idle(engine)


def test_no_prefix_cache_turns_every_reuse_off(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, prefix_file, enable_prefix_cache=False)
    assert engine.pool.num_pinned_blocks == 0
    assert [s.name for s in engine.prefixes.specs] == ["sys", "doc"]
    start = engine.runner.num_forward_tokens
    results = run_staggered(engine, [prompts[0]] * 2, SamplingParams(max_tokens=1), [0, 0])
    assert engine.runner.num_forward_tokens - start == 2 * len(prompts[0])
    assert [r[-1].num_cached_tokens for r in results] == [0, 0]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_reload_while_requests_stream(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]], tiny_tokenizer: Any
) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = _engine(tiny_llama_path, None).generate([prompts[0], prompts[4]], params)
    engine = _engine(tiny_llama_path, prefix_file)
    old_sys = engine.registry.prefixes["sys"]
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[4], params)
    outs: dict[str, list[int]] = {"a": [], "b": [], "new": []}

    def step() -> None:
        for o in engine.step():
            outs[o.request_id] += o.token_ids

    for _ in range(3):
        step()
    # Change "doc", remove "sys", add "greet"; then keep streaming through the reload.
    prefix_file.write_text(
        _yaml(
            DOC_ENTRY.replace("lazy dog", "lazy cat")
            + "  - name: greet\n    text: Hello there! How are you today?\n"
        )
    )
    statuses: list[Any] = []
    engine.reload_prefix_file(statuses.append)
    assert engine.prefixes.is_pending and "sys" in engine.registry.prefixes  # old set serves
    while engine.prefixes.is_pending:
        step()
    assert statuses[-1].ok is True
    assert sorted(engine.registry.prefixes) == ["doc", "greet"]
    assert not any(engine.pool.is_pinned(b) for b in old_sys.block_ids[:1])
    engine.check_integrity()  # requests still hold the old "sys" blocks: counted as holders
    greet = text_prompt_ids(tiny_tokenizer, "Hello there! How are you today? Fine")
    engine.add_request("new", greet, params)
    while engine.has_unfinished_requests():
        step()
    assert [outs["a"], outs["b"]] == reference  # in-flight outputs unchanged
    assert engine.registry.prefixes["greet"].stats.num_hits == 1
    _assert_idle(engine)


def test_unchanged_entries_keep_their_blocks(tiny_llama_path: Path, prefix_file: Path) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    sys_before = engine.registry.prefixes["sys"]
    blocks_before = list(sys_before.block_ids)
    old_doc = engine.registry.prefixes["doc"].token_ids
    start = engine.runner.num_forward_tokens
    prefix_file.write_text(_yaml(SYS_ENTRY + DOC_ENTRY.replace("lazy dog", "lazy cat")))
    engine.reload_prefix_file()
    while engine.prefixes.is_pending:
        engine.step()
    assert engine.registry.prefixes["sys"] is sys_before
    assert engine.registry.prefixes["sys"].block_ids == blocks_before
    filled = engine.runner.num_forward_tokens - start
    # Only "doc" was re-filled, and only from the block where it changed: the old entry's
    # full blocks before the change were shared (a partial registry hit).
    new_doc = engine.registry.prefixes["doc"].token_ids
    common = next(i for i, (a, b) in enumerate(zip(old_doc, new_doc, strict=False)) if a != b)
    assert common >= BLOCK
    assert filled == len(new_doc) - common // BLOCK * BLOCK
    _assert_idle(engine)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("version: 1\nprefixes: [", "prefixes.yaml"),
        (_yaml(SYS_ENTRY + SYS_ENTRY), "sys"),
        (_yaml("  - name: bad\n    text: hi\n    colour: red\n"), "colour"),
    ],
)
def test_invalid_reload_keeps_the_old_registry_and_reports(
    tiny_llama_path: Path, prefix_file: Path, content: str, needle: str
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    before = dict(engine.registry.prefixes)
    prefix_file.write_text(content)
    statuses: list[Any] = []
    engine.reload_prefix_file(statuses.append)
    assert not engine.prefixes.is_pending
    assert engine.registry.prefixes == before
    status = engine.registry.last_reload
    assert status.ok is False and status.error is not None and needle in status.error
    assert statuses == [status] and status.time is not None
    _assert_idle(engine)


def test_a_failed_reload_stays_reported_when_an_earlier_one_finishes(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    """A valid file still filling, then a bad one: the fill finishes and its entries serve
    (its caller hears success), but the status keeps the newer failure, which is what the
    file on disk still is (the watcher does not read unchanged bytes again). A later reload
    of the filling file itself makes it the newest outcome again."""
    engine = _engine(tiny_llama_path, prefix_file)
    grown = _yaml(SYS_ENTRY + DOC_ENTRY.replace(DOC, DOC + " plus a new tail to fill"))
    prefix_file.write_text(grown)
    outcomes: list[Any] = []
    engine.reload_prefix_file(outcomes.append)
    assert engine.prefixes.is_pending
    prefix_file.write_text("version: 1\nprefixes: [")
    engine.reload_prefix_file(outcomes.append)
    while engine.prefixes.is_pending:
        engine.step()
    assert [o.ok for o in outcomes] == [False, True]
    assert "new tail" in engine.registry.prefixes["doc"].spec.text
    assert engine.registry.last_reload is outcomes[0]
    prefix_file.write_text(grown.replace("new tail", "newer tail"))
    engine.reload_prefix_file()
    prefix_file.write_text("version: 1\nprefixes: [")
    engine.reload_prefix_file()
    prefix_file.write_text(grown.replace("new tail", "newer tail"))
    engine.reload_prefix_file()  # joins the pending reload of the same entries
    while engine.prefixes.is_pending:
        engine.step()
    assert engine.registry.last_reload.ok is True
    _assert_idle(engine)


def test_the_digest_names_what_the_registry_serves(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    """Equal for two engines on the same file and after a reload that changed nothing; new
    when an entry's text, name or tenants change; back when the file is."""
    engine = _engine(tiny_llama_path, prefix_file)
    other = _engine(tiny_llama_path, prefix_file)
    first = engine.stats().registry_digest
    assert len(first) == 16 and first == other.stats().registry_digest
    assert first != registry_digest(())
    original = prefix_file.read_text()
    seen = {first}
    for edited in (
        original.replace("name: doc", "name: doc2"),
        original.replace(DOC, DOC + " more"),
        original.replace("name: doc", "name: doc\n    tenants: [team-a]"),
    ):
        seen.add(_reloaded_digest(engine, prefix_file, edited))
    assert len(seen) == 4
    assert _reloaded_digest(engine, prefix_file, original) == first


def _reloaded_digest(engine: LLMEngine, prefix_file: Path, content: str) -> str:
    prefix_file.write_text(content)
    engine.reload_prefix_file()
    while engine.prefixes.is_pending:
        engine.step()
    assert engine.registry.last_reload.ok, engine.registry.last_reload.error
    return engine.stats().registry_digest


def _cached_for(engine: LLMEngine, prompt: list[int], tenant: str | None) -> int:
    """Tokens `tenant`'s request for `prompt` found cached."""
    request = engine.prepare_request(prompt, GREEDY, tenant=tenant)
    engine.add_prepared("probe", request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1].num_cached_tokens


def test_an_entry_leaves_the_scopes_its_tenants_list_leaves(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any
) -> None:
    """An entry's blocks are findable by content only in the registry scopes of the tenants
    it lists now: when `tenants:` is added, or a tenant taken off, with the same text (the
    blocks kept, no refill), the others no longer find them, whether the prompt holds the
    whole entry or diverges inside it; and when the entry is removed, nobody does."""
    engine = _engine(tiny_llama_path, prefix_file)
    doc_ids = text_prompt_ids(tiny_tokenizer, DOC)
    whole = [*doc_ids, *text_prompt_ids(tiny_tokenizer, " and more")]
    diverging = list(whole)
    diverging[3 * BLOCK + 1] = (diverging[3 * BLOCK + 1] + 1) % len(tiny_tokenizer)
    full = len(doc_ids) // BLOCK * BLOCK
    for tenant in (None, "team-a", "team-b"):
        assert _cached_for(engine, whole, tenant) >= full
        assert _cached_for(engine, diverging, tenant) == 3 * BLOCK
    original = prefix_file.read_text()
    for listed in ("team-a", "team-b"):
        edited = original.replace("name: doc", f"name: doc\n    tenants: [{listed}]")
        assert _reloaded_digest(engine, prefix_file, edited)
        for tenant in (None, "team-a", "team-b"):
            want = (full, 3 * BLOCK) if tenant == listed else (0, 0)
            got = (_cached_for(engine, whole, tenant), _cached_for(engine, diverging, tenant))
            assert (min(got[0], full), got[1]) == want, (listed, tenant, got)
    prefix_file.write_text(_yaml(SYS_ENTRY))
    assert _reloaded_digest(engine, prefix_file, _yaml(SYS_ENTRY))
    for tenant in (None, "team-a", "team-b"):
        assert _cached_for(engine, diverging, tenant) == 0, tenant
    _assert_idle(engine)


def test_the_digest_ignores_entry_order() -> None:
    a = PrefixSpec("a", "", "text", [], "abc", (1, 2, 3))
    b = PrefixSpec("b", "", "text", [], "de", (4, 5), tenants=("t1", "t2"))
    assert registry_digest([a, b]) == registry_digest([b, a])
    assert registry_digest([a, b]) != registry_digest([a])


def test_prefixes_that_crowd_out_requests_are_refused(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    with pytest.raises(PrefixBudgetError, match="Raise --kv-cache-memory"):
        _engine(tiny_llama_path, prefix_file, num_kv_blocks=70)  # 64 reserved for 256 tokens


def test_a_bad_file_fails_the_start(tiny_llama_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 2\n")
    with pytest.raises(RegistryFileError, match=r"bad\.yaml"):
        _engine(tiny_llama_path, path)


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        (("alice", "bob"), r"no API key is named 'alcie' \(the API keys' names: alice, bob\)"),
        ((), r"no API key is named 'alice', 'alcie' \(the server has no API keys"),
    ],
)
def test_a_tenant_no_key_is_named_fails_the_file(
    tiny_llama_path: Path, tmp_path: Path, keys: tuple[str, ...], says: str
) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(_yaml(SYS_ENTRY + DOC_ENTRY + "    tenants: [alice, alcie]\n"))
    with pytest.raises(
        RegistryFileError, match=rf"typo\.yaml: entry 'doc' field 'tenants': {says}"
    ):
        _engine(tiny_llama_path, path, tenant_names=keys)
    # the names the keys do have pass; and without a gateway (None) nothing is checked
    for names in (("alice", "alcie"), None):
        assert sorted(_engine(tiny_llama_path, path, tenant_names=names).registry.prefixes) == [
            "doc",
            "sys",
        ]


def test_async_engine_watches_the_file_and_reloads_on_request(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    llm = _engine(tiny_llama_path, prefix_file, prefix_watch_interval=0.02)
    engine = AsyncEngine(llm.config, engine=llm)
    engine.start()

    async def scenario() -> None:
        prefix_file.write_text(_yaml(DOC_ENTRY))
        for _ in range(500):  # the watcher polls every 20 ms
            names = await engine.run_in_engine(lambda e: sorted(e.registry.prefixes))
            if names == ["doc"]:
                break
            await asyncio.sleep(0.02)
        assert names == ["doc"]
        prefix_file.write_text(_yaml(DOC_ENTRY + SYS_ENTRY))
        status = await asyncio.wait_for(engine.reload_prefixes(), 60)
        assert status.ok is True and status.num_prefixes == 2

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    _assert_idle(llm)


def test_explain_names_the_match_or_the_closest_divergence(
    tiny_llama_path: Path, prefix_file: Path, prompts: list[list[int]], tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    sys_len = engine.registry.prefixes["sys"].num_tokens
    hit = engine.registry.explain(prompts[0])
    assert (hit.matched, hit.num_matched_tokens, hit.num_prompt_tokens) == (
        "sys",
        sys_len,
        len(prompts[0]),
    )
    other = chat_prompt_ids(
        tiny_tokenizer,
        [{"role": "system", "content": "You are a cat."}, {"role": "user", "content": "Hi"}],
    )
    miss = engine.registry.explain(other)
    sys_ids = engine.registry.prefixes["sys"].token_ids
    at = next(i for i, (a, b) in enumerate(zip(other, sys_ids, strict=False)) if a != b)
    assert (miss.matched, miss.closest, miss.diverged_at) == (None, "sys", at)
    assert (miss.prefix_token_id, miss.prompt_token_id) == (sys_ids[at], other[at])
    assert engine.registry.stats.num_lookups == 0  # the admin view counts nothing


def test_a_half_written_file_is_not_loaded_until_it_settles(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    assert engine.poll_prefix_file() is False  # unchanged since the start
    whole = _yaml(SYS_ENTRY + DOC_ENTRY + "  - name: greet\n    text: Hello there!\n")
    prefix_file.write_text(whole[: whole.index("  - name: doc")])  # valid YAML, one entry
    assert engine.poll_prefix_file() is False  # changed: wait for the next poll
    prefix_file.write_text(whole)  # the writer finishes before that poll
    assert engine.poll_prefix_file() is False  # changed again: wait again
    assert sorted(engine.registry.prefixes) == ["doc", "sys"]
    assert engine.poll_prefix_file() is True  # the same bytes twice: load them
    while engine.prefixes.is_pending:
        engine.step()
    assert sorted(engine.registry.prefixes) == ["doc", "greet", "sys"]
    assert engine.poll_prefix_file() is False
    _assert_idle(engine)


def test_a_bad_or_missing_file_is_reported_once_per_change(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    prefix_file.write_bytes(b"version: 1\nprefixes: [\xff")
    assert [engine.poll_prefix_file() for _ in range(4)] == [False, True, False, False]
    assert engine.registry.last_reload.ok is False
    assert "cannot read the file" in (engine.registry.last_reload.error or "")
    prefix_file.unlink()
    assert [engine.poll_prefix_file() for _ in range(4)] == [False, True, False, False]
    assert sorted(engine.registry.prefixes) == ["doc", "sys"]  # the old set still serves
    _assert_idle(engine)


def test_concurrent_reloads_coalesce_and_all_succeed(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    prefix_file.write_text(_yaml(SYS_ENTRY + DOC_ENTRY.replace("lazy dog", "lazy cat")))
    statuses: list[Any] = []
    for _ in range(3):  # the same file: the second and third join the first
        engine.reload_prefix_file(statuses.append)
    filling = engine.prefixes.num_pending_tokens
    assert filling == engine.prefixes.specs[1].num_tokens  # "doc" is filled once
    # Another file (new "doc", no "sys"): replaces the pending reload and answers its waiters.
    prefix_file.write_text(_yaml(DOC_ENTRY.replace("lazy dog", "lazy bird")))
    engine.reload_prefix_file(statuses.append)
    assert statuses == []
    while engine.prefixes.is_pending:
        engine.step()
    assert len(statuses) == 4 and all(s.ok and s.num_prefixes == 1 for s in statuses)
    assert sorted(engine.registry.prefixes) == ["doc"]
    _assert_idle(engine)


def test_a_contract_that_does_not_compile_fails_the_file(
    tiny_llama_path: Path, prefix_file: Path
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    before = dict(engine.registry.prefixes)
    bad = DOC_ENTRY + (
        "    response_format:\n      type: json_schema\n"
        "      json_schema: {name: x, schema: {type: strin}}\n"
    )
    prefix_file.write_text(_yaml(SYS_ENTRY + bad))
    statuses: list[Any] = []
    engine.reload_prefix_file(statuses.append)
    assert engine.registry.prefixes == before
    [status] = statuses
    assert status.ok is False
    assert "entry 'doc' field 'response_format': invalid JSON schema: " in (status.error or "")


def test_a_new_contract_on_unchanged_ids_is_served_without_a_refill(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path, prefix_file)
    blocks = list(engine.registry.prefixes["doc"].block_ids)
    start = engine.runner.num_forward_tokens
    prefix_file.write_text(
        _yaml(SYS_ENTRY + DOC_ENTRY + "    defaults: {temperature: 0.5, max_tokens: 7}\n")
    )
    engine.reload_prefix_file()
    while engine.prefixes.is_pending:
        engine.step()
    assert engine.runner.num_forward_tokens == start  # nothing was filled again
    assert engine.registry.prefixes["doc"].block_ids == blocks
    assert engine.registry.prefixes["doc"].spec.contract.max_tokens == 7
    contract = engine.prefix_contract(text_prompt_ids(tiny_tokenizer, DOC + " and more"))
    assert contract is not None and (contract.temperature, contract.max_tokens) == (0.5, 7)
    assert engine.prefix_contract(text_prompt_ids(tiny_tokenizer, "unrelated")) is None
    _assert_idle(engine)


# -- the registry inside the prefix cache ---------------------------------------------------------


@pytest.mark.parametrize("position", [0, 5, 9, 22])
def test_a_prompt_that_diverges_from_a_prefix_shares_the_blocks_before(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any, position: int
) -> None:
    """A registered prompt with one token different (an extra space, CRLF, a typo): every
    full block before the difference comes from the registry, even with the automatic cache
    off (its blocks are findable by content in the registry's own scope)."""
    engine = _engine(tiny_llama_path, prefix_file)
    plain = _engine(tiny_llama_path, None)
    doc_ids = text_prompt_ids(tiny_tokenizer, DOC)
    changed = [*doc_ids, *text_prompt_ids(tiny_tokenizer, " and more")]
    changed[position] = (changed[position] + 1) % len(tiny_tokenizer)
    [got] = run_staggered(engine, [changed], GREEDY, [0])
    [want] = run_staggered(plain, [changed], GREEDY, [0])
    assert got[-1].num_cached_tokens == position // BLOCK * BLOCK
    assert tokens_of(got) == tokens_of(want)
    assert engine.registry.stats.num_hits == 0
    assert engine.cache.num_partial_registry_hits == (1 if position >= BLOCK else 0)
    _assert_idle(engine)


def test_the_next_turn_after_a_registry_hit_reuses_prefix_and_answer(
    tiny_llama_path: Path, prefix_file: Path, tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path, prefix_file, enable_auto_prefix_cache=True)
    plain = _engine(tiny_llama_path, None)
    turn1 = _chat(tiny_tokenizer, QUESTIONS[0])
    [first] = run_staggered(engine, [turn1], GREEDY, [0])
    assert first[-1].num_cached_tokens == engine.registry.prefixes["sys"].num_tokens
    turn2 = turn1 + tokens_of(first) + text_prompt_ids(tiny_tokenizer, " And Spain?")
    [second] = run_staggered(engine, [turn2], GREEDY, [0])
    [want] = run_staggered(plain, [turn2], GREEDY, [0])
    computed = len(turn1) + len(tokens_of(first)) - 1  # all but the last answer token
    assert second[-1].num_cached_tokens == computed // BLOCK * BLOCK
    assert tokens_of(second) == tokens_of(want)
    # The first turn's blocks, registry ones included, are found in the prompt's own scope.
    assert engine.cache.num_auto_hits == 1
    _assert_idle(engine)
