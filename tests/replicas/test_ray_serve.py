"""`prefixgate serve --replicas 2` end to end: a local Ray instance started by the server this
test starts, two engine replicas of the tiny Llama behind the ingress, the OpenAI SDK in
front. Faults are real: a replica's worker process is killed with SIGKILL.

Marked `ray` (and `slow`): `make test-fast` skips it. One server for the module (~15 s to
start: Ray, then two replicas that load the model and fill the registry).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from replicas.spare_worker import PRELOAD_ENV_VAR
from tests.gateway.server_harness import (
    HTTP_TIMEOUT,
    Reference,
    Server,
    ServerFactory,
    greedy,
    wait_until,
)
from tools.bench_replica_replacement import replica_pids

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny-llama"
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 6144  # 24,576 tokens: six streams of 3,600 on one replica, if Serve says so
# The tiny Llama with room for streams that outlast a starved test's round trip to the
# ingress (its own config says 512 positions): 3,600 tokens take ~8 s on 2 cores.
MAX_MODEL_LEN = 4096
SYSTEM = "You are a helpful assistant. Answer the question briefly and politely."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]
FILE = f"""version: 1
prefixes:
  - name: sys
    messages:
      - role: system
        content: {SYSTEM}
"""
NEW_ENTRY = """  - name: doc
    text: "The quick brown fox jumps over the lazy dog. The scheduler admits new requests"
"""
READY_TIMEOUT = 120.0
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def prefix_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prefixes") / "prefixes.yaml"
    path.write_text(FILE)
    return path


@pytest.fixture(scope="module")
def long_llama_path(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's weights with `MAX_MODEL_LEN` positions (RoPE has no table to grow)."""
    path = tmp_path_factory.mktemp("models") / tiny_llama_path.name
    shutil.copytree(tiny_llama_path, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cluster(
    long_llama_path: Path, prefix_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    factory = ServerFactory(tmp_path_factory.mktemp("ray-logs"))
    server = factory(
        *("--replicas", "2", "--model", str(long_llama_path), "--dtype", "float32"),
        *("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"),
        *("--prefixes", str(prefix_file), "--prefix-watch-interval", "0.2"),
        *("--replica-timeout", "20", "--shutdown-grace", "2"),
        # Streams gather 3 tokens a message: the SDK's text must still equal the engine's.
        *("--stream-interval", "3"),
        ready_timeout=READY_TIMEOUT,
        name="ray",
    )
    yield server
    codes = factory.close()
    assert codes == {server.pid: 0}, server.log()
    assert not replica_pids(), "the engine replicas outlived the server"


@pytest.fixture(scope="module")
def reference(long_llama_path: Path) -> Reference:
    return Reference(long_llama_path, BLOCK_SIZE, NUM_KV_BLOCKS, MAX_MODEL_LEN)


@pytest.fixture
def sdk(cluster: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT
    ) as client:
        yield client


def _listing(server: Server) -> dict[str, Any]:
    listing: dict[str, Any] = server.get_json("/v1/prefixes")
    return listing


def _by_replica(server: Server, name: str) -> dict[str, float]:
    with server.client() as client:
        text = client.get("/metrics").text
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _spare_workers(proc: Path = Path("/proc")) -> list[int]:
    """Idle Ray workers started with our actors' runtime env (replicas/spare_worker.py)."""
    pids = []
    for entry in proc.iterdir():
        try:
            idle = entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(
                b"ray::IDLE"
            )
            if idle and f"{PRELOAD_ENV_VAR}=1".encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def _wait_healthy_pair(server: Server, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    def two_alike() -> dict[str, Any] | None:
        health = httpx.get(f"{server.url}/health", timeout=5.0)
        if health.status_code != 200 or health.json()["status"] != "ok":
            return None
        listing = _listing(server)
        replicas = listing["replicas"]
        digests = {r["digest"] for r in replicas}
        return listing if len(replicas) == 2 and len(digests) == 1 else None

    return wait_until(two_alike, timeout, "two replicas with one registry")


# -- the OpenAI API through the ingress ----------------------------------------------------------


def test_sdk_chat_through_the_ingress_equals_the_engine(
    sdk: openai.OpenAI, reference: Reference
) -> None:
    expected = reference.chat(MESSAGES, 12)
    completion = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, extra_body=IGNORE_EOS
    )
    assert completion.choices[0].message.content == expected
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12


def test_tokenize_and_logit_bias_through_the_ingress(
    sdk: openai.OpenAI, cluster: Server, reference: Reference
) -> None:
    """The ingress tokenizes as the replicas do, and a request's logit_bias reaches the
    replica that samples it."""
    ids = reference.chat_ids(MESSAGES)
    tokenized = cluster.post_json("/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert (tokenized["tokens"], tokenized["max_model_len"]) == (ids, MAX_MODEL_LEN)
    [first] = [o.token_ids[0] for o in reference.run(ids, greedy(1))]
    bias = ((first, -100.0), (9, 4.0))
    expected = reference.text(ids, greedy(12, logit_bias=bias))
    assert expected != reference.chat(MESSAGES, 12)
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=12,
        logit_bias={str(k): int(v) for k, v in bias},
        extra_body=IGNORE_EOS,
    )
    assert completion.choices[0].message.content == expected


def test_validation_errors_come_from_the_ingress_as_openai_errors(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=2)
    assert info.value.code == "invalid_token_id"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN + 1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="another-model", prompt="hi", max_tokens=2)


def test_structured_output_runs_on_a_replica(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = completion.choices[0].message.content or ""
    assert text.startswith("{"), text


def test_registry_hits_on_both_replicas(sdk: openai.OpenAI, cluster: Server) -> None:
    """Concurrent requests spread over both replicas; each one hits the registered prefix."""
    registered = _listing(cluster)["data"][0]["tokens"]

    def ask(i: int) -> int:
        messages = [MESSAGES[0], {"role": "user", "content": f"Question number {i}?"}]
        completion = sdk.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=8
        )
        assert completion.usage is not None and completion.usage.prompt_tokens_details
        return completion.usage.prompt_tokens_details.cached_tokens or 0

    hits: dict[str, float] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for round_ in range(10):  # until both replicas served some (power of two choices)
            cached = list(pool.map(ask, range(round_ * 8, round_ * 8 + 8)))
            assert all(c >= registered for c in cached), (cached, registered)
            hits = _by_replica(cluster, "prefixgate_prefix_cache_hits_total")
            if len(hits) == 2 and all(v > 0 for v in hits.values()):
                break
    assert len(hits) == 2 and all(v > 0 for v in hits.values()), hits
    replicas = _listing(cluster)["replicas"]
    assert all(r["hits"] > 0 for r in replicas), replicas


def test_a_conversation_stays_on_its_replica(sdk: openai.OpenAI) -> None:
    """Each second turn finds its first turn in the automatic prefix cache, past the
    registered prefix: it ran where the first turn ran. The conversations run at once, so
    Serve's router holds several requests, each preferring its own replica."""

    def converse(i: int) -> None:
        messages = [MESSAGES[0], {"role": "user", "content": f"Tell me about topic {i} " * 6}]
        first = sdk.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16
        )
        assert first.usage is not None
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And then?"},
        ]
        second = sdk.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=4
        )
        assert second.usage is not None and second.usage.prompt_tokens_details
        cached = second.usage.prompt_tokens_details.cached_tokens or 0
        assert cached >= first.usage.prompt_tokens - BLOCK_SIZE, (i, cached, first.usage)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(converse, range(6)))


def test_metrics_carry_a_replica_label(cluster: Server) -> None:
    blocks = _by_replica(cluster, "prefixgate_kv_blocks_total")
    assert list(blocks.values()) == [NUM_KV_BLOCKS, NUM_KV_BLOCKS]
    assert len(set(blocks)) == 2
    digests = _by_replica(cluster, "prefixgate_prefix_registry_info")
    assert len(digests) == 2


# -- one registry for all ----------------------------------------------------------------------


def test_a_reload_reaches_both_replicas_and_a_bad_one_keeps_the_old(
    cluster: Server, prefix_file: Path
) -> None:
    before = _wait_healthy_pair(cluster)
    try:
        prefix_file.write_text(FILE + NEW_ENTRY)
        with cluster.client() as client:
            response = client.post("/v1/prefixes/reload")
        assert response.status_code == 200, response.text
        assert response.json()["prefixes"] == 2
        after = _wait_healthy_pair(cluster)
        assert after["digest"] != before["digest"]
        assert sorted(p["name"] for p in after["data"]) == ["doc", "sys"]
        assert {r["prefixes"] for r in after["replicas"]} == {2}

        prefix_file.write_text("version: 1\nprefixes: [oops")
        with cluster.client() as client:
            response = client.post("/v1/prefixes/reload")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "prefix_reload_failed"
        names = [r["name"] for r in after["replicas"]]
        assert all(f"replica {name}" in error["message"] for name in names), error
        kept = _listing(cluster)
        assert kept["digest"] == after["digest"]
        assert all(r["last_reload"]["ok"] is False for r in kept["replicas"])
    finally:
        prefix_file.write_text(FILE)
        with cluster.client() as client:
            assert client.post("/v1/prefixes/reload").status_code == 200
    assert _wait_healthy_pair(cluster)["digest"] == before["digest"]


# -- faults ----------------------------------------------------------------------------------


def test_a_killed_replica_fails_only_its_requests_and_comes_back(
    cluster: Server, sdk: openai.OpenAI
) -> None:
    _wait_healthy_pair(cluster)
    # The server keeps a worker process started, with the package imported, for a replacement.
    spares = wait_until(lambda: _spare_workers() or None, READY_TIMEOUT, "a spare worker")
    params: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 3600}
    # One token a step: the streams must still be running when the replica dies. With drafts
    # (each story drafts from the others' answers) a fast machine finished the victim's
    # streams while the last of the six waited for its first chunk, and none failed.
    slow = {**IGNORE_EOS, "speculative": False}
    num_streams = 6
    started = time.monotonic()

    def stream(i: int) -> str:
        """ "ok", or the error code the stream ended with."""
        messages = [MESSAGES[0], {"role": "user", "content": f"A story {i}."}]
        try:
            for _ in sdk.chat.completions.create(
                messages=messages, stream=True, extra_body=slow, **params
            ):
                pass
        except openai.APIError as exc:
            return str(getattr(exc, "code", None) or exc.body)
        return "ok"

    def both_streaming() -> list[dict[str, Any]] | None:
        """The replicas when each streams a request, as the ingress counts them now (a
        stream Serve is slow to place must not hold the kill until the others ended)."""
        cards: list[dict[str, Any]] = _listing(cluster)["replicas"]
        return cards if len(cards) == 2 and all(c["streaming"] for c in cards) else None

    health_seen: list[tuple[int, str]] = []
    watching = threading.Event()

    def watch_health() -> None:
        """/health from the kill until the pair is whole again: the survivor serves, so a
        load balancer must keep sending traffic (200 "degraded", never 503)."""
        while not watching.is_set():
            health = httpx.get(f"{cluster.url}/health", timeout=5.0)
            health_seen.append((health.status_code, health.json().get("status", "")))
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(num_streams + 1) as pool:
        futures = [pool.submit(stream, i) for i in range(num_streams)]
        [victim_card, survivor_card] = wait_until(
            both_streaming, 30.0, "both replicas streaming", 0.02
        )
        victim, survivor = victim_card["pid"], survivor_card["pid"]
        assert {victim, survivor} == set(replica_pids())
        os.kill(victim, signal.SIGKILL)
        watcher = pool.submit(watch_health)
        outcomes = [f.result(timeout=60.0) for f in futures]
        streams_ended = time.monotonic()
        try:
            _wait_healthy_pair(cluster)
        finally:
            watching.set()
            watcher.result(timeout=10.0)
    assert streams_ended - started < 60.0
    # The ingress gave three streams to each replica (`AffinityTable.choose`); Serve may still
    # move one whose replica was slow to answer its queue-length probe. The victim's fail.
    failed = [o for o in outcomes if o != "ok"]
    # Its requests only: those it streamed at the kill, and none the survivor streamed.
    low, high = victim_card["streaming"], num_streams - survivor_card["streaming"]
    assert low <= len(failed) <= high, (outcomes, victim_card, survivor_card)
    assert set(failed) == {"engine_unavailable"}, outcomes
    # The ingress knew it was short a replica (/health says "degraded" then; the replacement
    # may be back before a sample lands in that window) and /health stayed 200 throughout.
    dropped = f"ingress: replica {victim_card['name']} stopped reporting; 1 of 2"
    wait_until(lambda: dropped in cluster.log(100_000), 10.0, "the ingress's line")
    assert health_seen and all(c == 200 for c, _ in health_seen), health_seen
    # Serve restarts the replica; it refills the registry before it serves, then /health is
    # 200 "ok" again with two replicas holding the same registry.
    listing = _wait_healthy_pair(cluster)
    assert survivor in replica_pids() and victim not in replica_pids()
    [replacement] = set(replica_pids()) - {survivor}
    assert replacement in spares, "the replacement started a new worker, not the spare"
    assert all(r["prefixes"] == 1 for r in listing["replicas"])
    completion = sdk.chat.completions.create(
        messages=MESSAGES, extra_body=IGNORE_EOS, **{**params, "max_tokens": 4}
    )
    assert completion.choices[0].finish_reason == "length"
