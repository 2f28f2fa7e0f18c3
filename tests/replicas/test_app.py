"""The Serve config's `args` are `prefixgate serve` flags (deploy/serve.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from replicas.app import app_builder, config_from_serve_args

REPO = Path(__file__).resolve().parents[2]


def test_args_become_the_same_config_as_the_flags() -> None:
    config = config_from_serve_args(
        {
            "replicas": 3,
            "prefixes": "prefixes.yaml",
            "num_threads": 1,
            "api-key": ["a=k1", "b=k2"],
            "no_auto_prefix_cache": True,
            "debug_check_integrity": False,
            "served_model_name": None,
        }
    )
    assert config.replicas == 3
    assert config.engine.prefix_file == "prefixes.yaml"
    assert config.engine.num_threads == 1
    assert config.api_keys == ("a=k1", "b=k2")
    assert not config.engine.enable_auto_prefix_cache
    assert not config.engine.debug_check_integrity
    assert config.served_model_name is None


def test_the_shipped_serve_config_builds() -> None:
    """deploy/serve.yaml's application builds (nothing starts: Serve is not running)."""
    document = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    [application] = document["applications"]
    assert application["import_path"] == "replicas.app:app_builder"
    config = config_from_serve_args(application["args"])
    assert config.replicas >= 2
    assert app_builder(application["args"]) is not None


def test_bad_args_are_a_value_error_naming_them() -> None:
    """Serve's builder gets an error it can report, not argparse's exit."""
    with pytest.raises(ValueError, match="argument --replicas: invalid int value: 'two'"):
        config_from_serve_args({"replicas": "two"})


def test_every_replica_is_given_the_same_snapshot_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative --kv-snapshot-dir (or the environment's) names one folder for every replica,
    wherever Ray starts them; with neither, each replica keeps its host's default."""
    from engine import EngineConfig
    from replicas.app import _absolute_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFIXGATE_KV_SNAPSHOT_DIR", raising=False)
    named = _absolute_paths(EngineConfig(kv_snapshot_dir="snaps"))
    assert named.kv_snapshot_dir == str(tmp_path / "snaps")
    assert _absolute_paths(EngineConfig()).kv_snapshot_dir is None
    monkeypatch.setenv("PREFIXGATE_KV_SNAPSHOT_DIR", "from-env")
    assert _absolute_paths(EngineConfig()).kv_snapshot_dir == str(tmp_path / "from-env")
