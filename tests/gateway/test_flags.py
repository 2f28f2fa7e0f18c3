"""gateway.flags / `prefixgate serve`: every config field has exactly one generated flag."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest

from engine import EngineConfig, default_cache_dir
from gateway import config as gateway_config
from gateway.cli import build_parser, engine_config_from_args
from gateway.config import GatewayConfig
from gateway.flags import config_from_args, parse_size
from prefixgate.cli import main


def _serve(argv: list[str]) -> GatewayConfig:
    args = build_parser().parse_args(["serve", *argv])
    return config_from_args(
        GatewayConfig, args, skip=("engine",), engine=engine_config_from_args(args)
    )


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "PREFIXGATE_API_KEY",
        "PREFIXGATE_ADMIN_API_KEY",
        "PREFIXGATE_METRICS_API_KEY",
        "PREFIXGATE_RESPONSE_STORE",  # tests/conftest.py points it at a file of the run
    ):
        monkeypatch.delenv(name, raising=False)


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert _serve([]) == GatewayConfig()


def test_every_field_has_a_flag_that_sets_it() -> None:
    config = _serve(
        [
            *("--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--admin-api-key", "a"),
            *("--api-key", "b=k2", "--api-key-file", "keys.txt"),
            *("--max-waiting", "7", "--shutdown-grace", "2.5", "--served-model-name", "m"),
            *("--keep-alive-timeout", "90"),
            *("--max-request-bytes", "1MiB", "--request-read-timeout", "3"),
            *("--metrics-api-key", "mk", "--allowed-origins", "https://a.example", "*"),
            *("--default-max-tokens", "99", "--max-prompts", "5", "--tokenizer-workers", "3"),
            *("--model", "/m", "--device", "cuda:1", "--dtype", "bfloat16", "--block-size", "8"),
            *("--kv-cache-dtype", "float16"),
            *("--num-kv-blocks", "100", "--kv-cache-memory", "1.5g", "--max-num-seqs", "4"),
            *("--max-num-batched-tokens", "64", "--max-model-len", "512", "--no-prefix-cache"),
            *("--max-itl-ms", "80"),
            *("--no-auto-prefix-cache", "--quantization", "int8", "--no-compile"),
            *("--no-grammar-fast-forward", "--speculative", "off"),
            *("--num-speculative-tokens", "3"),
            *("--prefixes", "p.yaml", "--prefix-watch-interval", "0.5", "--num-threads", "2"),
            *("--chat-template", "t.jinja", "--no-kv-snapshots", "--kv-snapshot-dir", "/snap"),
            *("--default-chat-template-kwargs", '{"enable_thinking": false}'),
            *("--kv-snapshot-budget", "64MiB"),
            *("--seed", "11", "--debug-check-integrity", "--response-store", "memory"),
            *("--response-store-entries", "9"),
            *("--response-store-bytes", "2MiB", "--response-store-ttl", "60"),
            *("--replicas", "3", "--ray-address", "auto", "--replica-cpus", "1.5"),
            *("--replica-timeout", "9", "--affinity-slack", "2", "--stream-interval", "4"),
        ]
    )
    engine = EngineConfig(
        model="/m",
        device="cuda:1",
        dtype="bfloat16",
        kv_cache_dtype="float16",
        quantization="int8",
        block_size=8,
        num_kv_blocks=100,
        kv_cache_memory=int(1.5 * 2**30),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_itl_ms=80.0,
        max_model_len=512,
        enable_prefix_cache=False,
        enable_auto_prefix_cache=False,
        enable_grammar_fast_forward=False,
        speculative="off",
        num_speculative_tokens=3,
        enable_kv_snapshots=False,
        kv_snapshot_dir="/snap",
        kv_snapshot_budget=64 << 20,
        enable_compile=False,
        chat_template="t.jinja",
        default_chat_template_kwargs='{"enable_thinking": false}',
        prefix_file="p.yaml",
        prefix_watch_interval=0.5,
        num_threads=2,
        seed=11,
        debug_check_integrity=True,
    )
    assert config == GatewayConfig(
        engine=engine,
        host="0.0.0.0",
        port=9001,
        api_keys=("k", "b=k2"),
        api_key_file="keys.txt",
        admin_api_key="a",
        keep_alive_timeout=90.0,
        max_waiting=7,
        shutdown_grace=2.5,
        served_model_name="m",
        max_request_bytes=1 << 20,
        request_read_timeout=3.0,
        metrics_api_key="mk",
        allowed_origins=("https://a.example", "*"),
        default_max_tokens=99,
        max_prompts=5,
        response_store="memory",
        response_store_entries=9,
        response_store_bytes=2 << 20,
        response_store_ttl=60.0,
        tokenizer_workers=3,
        replicas=3,
        ray_address="auto",
        replica_cpus=1.5,
        replica_timeout=9.0,
        stream_interval=4,
        affinity_slack=2,
    )
    # The command line above names each field once: nothing was left at its default. The
    # fields that are no flag are set by the server itself, and only these.
    not_flags = set()
    for config_type, value in ((GatewayConfig, config), (EngineConfig, engine)):
        for field in dataclasses.fields(config_type):
            if "help" in field.metadata:
                assert getattr(value, field.name) != field.default, field.name
            else:
                not_flags.add(field.name)
    assert not_flags == {"engine", "tenant_names"}  # the engine's; the API keys' names


def test_keys_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXGATE_API_KEY", "from-env")
    monkeypatch.setenv("PREFIXGATE_ADMIN_API_KEY", "admin-env")
    config = _serve([])
    assert (config.api_keys, config.admin_api_key, config.metrics_api_key) == (
        ("from-env",),
        "admin-env",
        None,
    )
    # Given on the command line, the flag replaces the environment's key.
    assert _serve(["--api-key", "flag", "--api-key", "x=y"]).api_keys == ("flag", "x=y")


def test_the_response_store_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve([]).response_store == "sqlite"
    monkeypatch.setenv("PREFIXGATE_RESPONSE_STORE", "memory")
    assert _serve([]).response_store == "memory"
    assert _serve(["--response-store", "sqlite:/r.db"]).response_store == "sqlite:/r.db"


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ("memory", None),
        ("sqlite:/srv/responses.db", Path("/srv/responses.db")),
        ("sqlite:~/r.db", Path.home() / "r.db"),
        ("sqlite:relative/r.db", Path("relative/r.db")),
    ],
)
def test_where_responses_are_kept(value: str, path: Path | None) -> None:
    assert GatewayConfig(response_store=value).response_db_path == path


def test_plain_sqlite_is_the_file_in_the_cache_dir() -> None:
    assert GatewayConfig().response_db_path == gateway_config.default_response_db()
    # tests/conftest.py moved it into this run's temporary files.
    assert not gateway_config.default_response_db().is_relative_to(default_cache_dir())


@pytest.mark.parametrize("value", ["disk", "sqlite:", "sqlite3:/r.db", "Memory", "memory:", ""])
def test_a_bad_response_store_is_refused(value: str) -> None:
    with pytest.raises(ValueError) as refused:
        GatewayConfig(response_store=value)
    assert str(refused.value) == (
        f"response_store must be memory, sqlite or sqlite:PATH, not {value!r}"
    )


def test_a_bad_response_store_stops_the_server_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="prefixgate"):
        assert main(["serve", "--response-store", "disk"]) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "prefixgate"] == [
        "response_store must be memory, sqlite or sqlite:PATH, not 'disk'"
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [("1000", 1000), ("512M", 512 << 20), ("2GiB", 2 << 30), ("1.5g", 3 << 29), ("4 KB", 4096)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1M", "2 PB", "1e3"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def test_bad_values_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--dtype", "float16"])
    assert exited.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err
