"""API keys as tenants (in-process, tiny Llama): each key's automatically cached prompts are
invisible to the others (cached_tokens stays 0 for a prompt another tenant sent), a registry
entry limited by `tenants:` is hit and listed only for them, stored responses belong to their
tenant, and the key ring reads keys and key files as documented."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.tenants import KeyRing
from tests.gateway.server_harness import wait_until
from tests.helpers import tiny_app

MODEL = "tiny-llama"
SHARED = "You are a helpful assistant. Answer the question briefly and politely."
SECRET = "Internal playbook of Alice's team: escalate refunds above one hundred euros."
PREFIXES = f"""version: 1
prefixes:
  - name: shared
    messages:
      - role: system
        content: {SHARED}
  - name: secret
    tenants: [alice]
    text: "{SECRET}"
"""
KEYS = {"alice": "key-alice", "bob": "key-bob"}
ADMIN = "key-admin"
NOT_READY = "The server is not ready: it is still loading the model and its prefixes."


@pytest.fixture(scope="module")
def client(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = tmp_path_factory.mktemp("tenants") / "prefixes.yaml"
    path.write_text(PREFIXES)
    keys = {"api_keys": tuple(f"{name}={key}" for name, key in KEYS.items())}
    app = tiny_app(
        tiny_llama_path,
        {**keys, "admin_api_key": ADMIN},
        max_model_len=256,
        prefix_file=str(path),
        debug_check_integrity=True,
    )
    with TestClient(app) as test_client:
        yield test_client


def _as(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS.get(tenant, ADMIN)}"}


def _cached(client: TestClient, tenant: str, prompt: str, **fields: Any) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body, headers=_as(tenant))
    assert response.status_code == 200, response.text
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_one_tenants_prompt_is_invisible_to_another(client: TestClient) -> None:
    prompt = "Alice's private draft: the merger closes on the fourth of June, tell nobody."
    assert _cached(client, "alice", prompt) == 0
    assert _cached(client, "alice", prompt) > 0  # her own repeat hits her own cache
    assert _cached(client, "bob", prompt) == 0  # the guess is not confirmed
    assert _cached(client, "bob", prompt) > 0  # his own repeat hits his own cache
    assert _cached(client, "alice", prompt, cache_salt="narrow") == 0  # a salt narrows it


def test_a_tenant_scoped_entry_is_hit_only_by_its_tenants(client: TestClient) -> None:
    prompt = SECRET + " What now?"
    secret_tokens = _cached(client, "alice", prompt)
    assert secret_tokens > 0
    assert _cached(client, "bob", prompt) == 0
    assert _cached(client, "admin", prompt) == 0  # the admin key's requests are nobody's
    shared = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Hi"}]
    for tenant in ("alice", "bob"):  # the shared entry is everybody's
        body = {"model": MODEL, "messages": shared, "max_tokens": 1, "cache_salt": tenant}
        response = client.post("/v1/chat/completions", json=body, headers=_as(tenant))
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_listing_and_match_show_only_what_the_caller_may_hit(client: TestClient) -> None:
    def names(tenant: str) -> dict[str, Any]:
        listing = client.get("/v1/prefixes", headers=_as(tenant))
        assert listing.status_code == 200, listing.text
        return {card["name"]: card["tenants"] for card in listing.json()["data"]}

    assert names("alice") == {"shared": None, "secret": None}
    assert names("bob") == {"shared": None}
    assert names("admin") == {"shared": None, "secret": ["alice"]}
    body = {"model": MODEL, "prompt": SECRET + " What now?", "cache_salt": "fresh"}
    bob = client.post("/v1/prefixes/match", json=body, headers=_as("bob")).json()
    assert bob["matched"] is None and bob["cached_tokens"] == 0
    assert bob["closest"] is None or bob["closest"]["name"] != "secret"
    alice = client.post("/v1/prefixes/match", json=body, headers=_as("alice")).json()
    assert alice["matched"] == "secret" and alice["cache_source"] == "registry"
    reload = client.post("/v1/prefixes/reload", headers=_as("alice"))
    assert reload.status_code == 403


def test_stored_responses_belong_to_their_tenant(client: TestClient) -> None:
    body = {"model": MODEL, "input": "Remember 42.", "max_output_tokens": 2}
    created = client.post("/v1/responses", json=body, headers=_as("alice")).json()
    assert client.get(f"/v1/responses/{created['id']}", headers=_as("alice")).status_code == 200
    assert client.get(f"/v1/responses/{created['id']}", headers=_as("bob")).status_code == 404
    chained = {**body, "previous_response_id": created["id"]}
    stolen = client.post("/v1/responses", json=chained, headers=_as("bob"))
    assert stolen.status_code == 404
    assert stolen.json()["error"]["code"] == "response_not_found"
    own = client.post("/v1/responses", json=chained, headers=_as("alice"))
    assert own.status_code == 200


def test_a_reload_naming_a_tenant_no_key_has_is_refused(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    """The keys' names reach the engine the server builds itself (not a test's ready one):
    a misspelt `tenants:` name fails the reload, and the entry keeps serving its tenant."""
    path = tmp_path / "prefixes.yaml"
    path.write_text(PREFIXES)
    engine = EngineConfig(
        model=str(tiny_llama_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=512,
        max_model_len=256,
        prefix_file=str(path),
    )
    keys = tuple(f"{name}={key}" for name, key in KEYS.items())
    app = create_app(GatewayConfig(engine=engine, api_keys=keys, admin_api_key=ADMIN))
    with TestClient(app) as client:
        wait_until(lambda: client.get("/health").status_code == 200, 120, "/health 200")
        path.write_text(PREFIXES.replace("tenants: [alice]", "tenants: [Alice]"))
        reload = client.post("/v1/prefixes/reload", headers=_as("admin"))
        assert reload.status_code == 400, reload.text
        error = reload.json()["error"]
        assert error["code"] == "prefix_reload_failed"
        assert "entry 'secret' field 'tenants': no API key is named 'Alice'" in error["message"]
        assert "(the API keys' names: alice, bob)" in error["message"]
        assert _cached(client, "alice", SECRET + " What now?") > 0
        assert _cached(client, "bob", SECRET + " What now?") == 0


def test_a_start_naming_a_tenant_no_key_has_fails_in_one_line(
    tiny_llama_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At start such a file fails the engine: /health says why, and the log says it in one
    line (the operator's file to mend, not a traceback of ours)."""
    path = tmp_path / "prefixes.yaml"
    path.write_text(PREFIXES.replace("tenants: [alice]", "tenants: [Alice]"))
    engine = EngineConfig(
        model=str(tiny_llama_path), dtype="float32", block_size=4, num_kv_blocks=512,
        max_model_len=256, prefix_file=str(path),
    )  # fmt: skip
    keys = tuple(f"{name}={key}" for name, key in KEYS.items())
    app = create_app(GatewayConfig(engine=engine, api_keys=keys, admin_api_key=ADMIN))
    with caplog.at_level(logging.ERROR, logger="gateway.state"), TestClient(app) as client:
        health = wait_until(
            lambda: (r := client.get("/health")).json()["error"]["message"] != NOT_READY and r,
            120,
            "the failed start",
        )
    assert health.status_code == 503
    assert "no API key is named 'Alice'" in health.json()["error"]["message"]
    [record] = [r for r in caplog.records if r.name == "gateway.state"]
    assert record.getMessage().startswith("engine failed to start: ")
    assert "no API key is named 'Alice' (the API keys' names: alice, bob)" in record.getMessage()
    assert record.exc_info is None


# -- the key ring ----------------------------------------------------------------------------


def test_keys_names_and_files(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\ncarol: key-c\n\n  dave :  key-d  \n")
    ring = KeyRing(("key-a", "bob=key-b"), str(key_file))
    alice, bob = ring.tenant_of("key-a"), ring.tenant_of("key-b")
    assert alice is not None and re.fullmatch(r"key-[0-9a-f]{8}", alice.name)
    assert ring.names == sorted(["bob", "carol", "dave", alice.name])
    assert bob is not None and bob.name == "bob"
    assert ring.tenant_of("key-d") is not None and ring.tenant_of("key-x") is None
    assert ring.tenant_of(None) is None
    assert alice.scope != bob.scope and len(alice.scope) == 64
    assert KeyRing().is_empty


def test_an_unnamed_keys_tenant_is_the_same_whatever_other_keys_are_given() -> None:
    """What a tenant owns (stored responses) follows its name: revoking or reordering other
    keys must not hand an unnamed key's name, and so its belongings, to another key."""
    rings = [
        KeyRing(("key-one", "key-two")),
        KeyRing(("key-two",)),
        KeyRing(("key-two", "key-one")),
    ]
    names = {ring.tenant_of("key-two") for ring in rings}
    assert None not in names and len({t.name for t in names if t is not None}) == 1
    one, two = rings[0].tenant_of("key-one"), rings[0].tenant_of("key-two")
    assert one is not None and two is not None and one.name != two.name


@pytest.mark.parametrize("key", ["dG9rZW4=", "c2VjcmV0LWtleQ==", "bob="])
def test_a_key_ending_in_padding_is_the_whole_key_and_an_empty_one_matches_nothing(
    key: str,
) -> None:
    """Base64 keys end in `=`: read as NAME=KEY they were the name and an empty key (or
    `=`), which an empty `x-api-key` header or `Bearer =` then matched."""
    ring = KeyRing((key,))
    tenant = ring.tenant_of(key)
    assert tenant is not None and tenant.name.startswith("key-")
    assert key.split("=")[0] not in tenant.name  # no part of the key in names or logs
    for token in ("", "=", "==", None):
        assert ring.tenant_of(token) is None, token


@pytest.mark.parametrize(
    ("keys", "file_text", "message"),
    [
        (("",), None, "empty"),
        (("a=k1", "a=k2"), None, "given twice"),
        (("a=k1", "b=k1"), None, "are equal"),
        ((), "no separator here\n", "expected 'NAME: KEY'"),
        ((), "bad name!: k\n", "expected 'NAME: KEY'"),
    ],
)
def test_bad_keys_are_refused(
    tmp_path: Path, keys: tuple[str, ...], file_text: str | None, message: str
) -> None:
    key_file = None
    if file_text is not None:
        key_file = tmp_path / "keys.txt"
        key_file.write_text(file_text)
    with pytest.raises(ValueError, match=message):
        KeyRing(keys, str(key_file) if key_file else None)
