"""The command line: flags (one per config field) to a SoakConfig, then run, report, and the
exit status: 0 pass, 1 an invariant broke, 2 the soak could not run."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

import tools.soak
from tools.soak.config import (
    EditSettings,
    LoadSettings,
    ServerSettings,
    SoakConfig,
    SoakError,
    check_local_url,
)
from tools.soak.report import build_report, format_table
from tools.soak.runner import run

Number = TypeVar("Number", int, float)
COMMAND = ("python", "-m", "tools.soak")
KEY_FLAGS = ("--api-key", "--admin-api-key")


def _checked(
    convert: Callable[[str], Number], is_ok: Callable[[Number], bool], rule: str
) -> Callable[[str], Number]:
    """An argparse `type`: `convert`, then refuse a value outside `rule`."""

    def parse(text: str) -> Number:
        value = convert(text)
        if not is_ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = f"{convert.__name__} {rule}"  # argparse names it in its own errors
    return parse


_fraction = _checked(float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
_positive_float = _checked(float, lambda v: v > 0, "> 0")
_non_negative_float = _checked(float, lambda v: v >= 0, ">= 0")
_positive_int = _checked(int, lambda v: v >= 1, ">= 1")


def _local_url(text: str) -> str:
    try:
        return check_local_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _d(text: str) -> str:
    """A help text followed by the option's default."""
    return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=" ".join(COMMAND),
        description=tools.soak.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_flags(p.add_argument)
    _add_load_flags(p.add_argument)
    _add_edit_flags(p.add_argument)
    _add_run_flags(p.add_argument)
    _add_server_flags(p.add_argument_group("the started server (ignored with --url)").add_argument)
    return p


AddArgument = Callable[..., argparse.Action]


def _add_target_flags(add: AddArgument) -> None:
    add("--model", help="HF folder or .gguf to serve (default: the embedded SmolLM2)")
    add("--url", type=_local_url, help="soak this running server (127.0.0.1/localhost only)")
    add("--prefixes-file", type=Path, help="with --url: the file it watches (restored after)")
    env_key, env_admin = os.environ.get("PREFIXGATE_API_KEY"), "PREFIXGATE_ADMIN_API_KEY"
    add("--api-key", default=env_key, help="with --url (default: $PREFIXGATE_API_KEY)")
    add("--admin-api-key", default=os.environ.get(env_admin), help=f"with --url (${env_admin})")


def _add_load_flags(add: AddArgument) -> None:
    add(
        "--duration",
        type=_positive_float,
        default=180.0,
        metavar="S",
        help=_d("stop sending after S s"),
    )
    add("--max-requests", type=_positive_int, default=2000, metavar="N", help=_d("send at most N"))
    add("--concurrency", type=_positive_int, default=6, metavar="C", help=_d("in flight"))
    add("--disconnect-rate", type=_fraction, default=0.2, metavar="F", help=_d("client cuts"))
    add("--long-rate", type=_fraction, default=0.25, metavar="F", help=_d("long requests"))
    add("--hostile-rate", type=_fraction, default=0.1, metavar="F", help=_d("hostile bodies"))
    add("--stream-rate", type=_fraction, default=0.6, metavar="F", help=_d("streaming"))
    add("--short-max-tokens", type=_positive_int, default=16, metavar="N", help=_d("at most"))
    add("--long-max-tokens", type=_positive_int, metavar="N", help="default: max_model_len / 2")
    add(
        "--request-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help=_d("then a hang"),
    )


def _add_edit_flags(add: AddArgument) -> None:
    add("--edit-interval", type=_non_negative_float, default=5.0, metavar="S", help=_d("0: none"))
    add("--max-edits", type=_positive_int, metavar="N", help="N edits even if the load ends")
    add("--invalid-edit-rate", type=_fraction, default=0.2, metavar="F", help=_d("of edits"))
    add("--truncated-edit-rate", type=_fraction, default=0.2, metavar="F", help=_d("of edits"))
    add("--truncated-pause", type=_non_negative_float, default=0.5, metavar="S", help=_d("< 1 s"))
    add("--settle-timeout", type=_positive_float, default=60.0, metavar="S", help=_d("an edit"))


def _add_run_flags(add: AddArgument) -> None:
    add("--idle-timeout", type=_positive_float, default=120.0, metavar="S", help=_d("at the end"))
    add("--seed", type=int, default=0, help=_d("traffic and edits"))
    add("--out", type=Path, help="write the JSON report here")
    add("--work-dir", type=Path, help="server log and prefixes file (default: a new temp dir)")


def _add_server_flags(add: AddArgument) -> None:
    add("--block-size", type=_positive_int, default=16, help=_d("tokens"))
    add("--num-kv-blocks", type=_positive_int, default=48, help=_d("small: preemptions"))
    add("--max-model-len", type=_positive_int, default=512, help=_d("tokens"))
    add("--max-num-seqs", type=_positive_int, default=8, help=_d("batch"))
    add("--ready-timeout", type=_positive_float, default=300.0, metavar="S", help=_d("start"))
    add(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="e.g. --server-arg=--dtype=bfloat16",
    )


def config_from_args(args: argparse.Namespace, command: str) -> SoakConfig:
    if args.edit_interval > 0 and args.url is not None and args.prefixes_file is None:
        raise SoakError("--url with edits needs --prefixes-file (or --edit-interval 0)")
    return SoakConfig(
        server=ServerSettings(
            model=args.model,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            extra_args=tuple(args.server_arg),
            ready_timeout_s=args.ready_timeout,
        ),
        load=LoadSettings(
            duration_s=args.duration,
            max_requests=args.max_requests,
            concurrency=args.concurrency,
            disconnect_rate=args.disconnect_rate,
            long_rate=args.long_rate,
            hostile_rate=args.hostile_rate,
            stream_rate=args.stream_rate,
            short_max_tokens=args.short_max_tokens,
            long_max_tokens=args.long_max_tokens,
            request_timeout_s=args.request_timeout,
        ),
        edits=EditSettings(
            interval_s=args.edit_interval,
            max_edits=args.max_edits,
            invalid_rate=args.invalid_edit_rate,
            truncated_rate=args.truncated_edit_rate,
            truncated_pause_s=args.truncated_pause,
            settle_timeout_s=args.settle_timeout,
        ),
        url=args.url,
        prefixes_file=args.prefixes_file,
        api_key=args.api_key if args.url else None,
        admin_api_key=args.admin_api_key if args.url else None,
        seed=args.seed,
        work_dir=args.work_dir,
        idle_timeout_s=args.idle_timeout,
        command=command,
    )


def redacted(argv: Sequence[str]) -> list[str]:
    """argv with key values hidden (the command is printed and saved)."""
    out = list(argv)
    for i, arg in enumerate(out):
        for flag in KEY_FLAGS:
            if arg == flag and i + 1 < len(out):
                out[i + 1] = "<redacted>"
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}=<redacted>"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args, shlex.join([*COMMAND, *redacted(argv)]))
        outcome = run(config)
    except (SoakError, OSError, httpx.HTTPError) as exc:
        print(f"soak could not run: {exc}", file=sys.stderr)
        return 2
    report = build_report(config, outcome)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    return 0 if not report["failures"] else 1
