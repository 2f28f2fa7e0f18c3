"""Ray is optional: the single-process server never imports it."""

from __future__ import annotations

import subprocess
import sys

from prefixgate.cli import main

NO_RAY = (
    "import sys, gateway.cli, gateway.app, gateway.server, gateway.state; "
    "from gateway.config import GatewayConfig; "
    "from gateway.app import create_app; create_app(GatewayConfig()); "
    "assert not [m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'replicas'))], "
    "sorted(m for m in sys.modules if m.startswith(('ray', 'replicas')))"
)


def test_the_single_process_server_does_not_import_ray() -> None:
    done = subprocess.run([sys.executable, "-c", NO_RAY], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_replicas_below_two_stay_in_one_process() -> None:
    from gateway.cli import build_parser, gateway_config_from_args

    config = gateway_config_from_args(build_parser().parse_args(["serve", "--replicas", "1"]))
    assert not config.uses_ray
    config = gateway_config_from_args(build_parser().parse_args(["serve", "--replicas", "2"]))
    assert config.uses_ray
    config = gateway_config_from_args(build_parser().parse_args(["serve", "--ray-address", "auto"]))
    assert config.uses_ray


def test_a_bad_replica_count_is_refused_on_the_command_line() -> None:
    assert main(["serve", "--replicas", "0"]) == 2
