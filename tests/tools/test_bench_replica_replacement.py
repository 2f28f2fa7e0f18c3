"""bench_replica_replacement's pure parts: finding replica processes, the healthy-pair test,
the replica's own log timeline and the summary over kills."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from tools.bench_replica_replacement import (
    Replacement,
    healthy_pair,
    markdown,
    replica_log_seconds,
    replica_pids,
    summarize,
)


def test_replica_processes_are_found_by_ray_s_process_title(tmp_path: Path) -> None:
    for pid, command in [
        (17, b"ray::ServeReplica:prefixgate:engine\x00"),
        (5, b"ray::ServeReplica:prefixgate:engine\x00"),
        (23, b"ray::ServeReplica:prefixgate:ingress\x00"),  # the ingress is not an engine
        (31, b"python\x00-m\x00prefixgate\x00serve\x00"),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(command)
    (tmp_path / "self").mkdir()  # not a pid
    (tmp_path / "40").mkdir()  # gone meanwhile: no cmdline
    assert replica_pids(tmp_path) == [5, 17]


def test_a_healthy_pair_is_two_replicas_that_agree_on_the_registry() -> None:
    assert healthy_pair({"replicas": [{"digest": "a"}, {"digest": "a"}]})
    assert not healthy_pair({"replicas": [{"digest": "a"}, {"digest": "b"}]})  # reload midway
    assert not healthy_pair({"replicas": [{"digest": "a"}]})  # one gone
    assert not healthy_pair({"replicas": [{"digest": None}, {"digest": None}]})  # not answering
    assert not healthy_pair({})  # the listing failed


def test_the_replica_s_log_lines_are_placed_after_the_kill() -> None:
    killed_at = datetime(2026, 11, 27, 14, 39, 6, 226000).timestamp()
    prefix = "\x1b[36m(ServeReplica:prefixgate:engine pid=2560)\x1b[0m "
    lines = [
        prefix + "2026-11-27 14:39:15,936 INFO engine.loading.source: using cached conversion",
        prefix + "no timestamp on this one",
        prefix + "2026-11-27 14:39:26,469 INFO engine.kv_snapshots: prefix 'a': restored",
        prefix + "2026-11-27 14:39:26,492 INFO replicas.replica: replica rdjxs78h serves SmolLM2",
    ]
    assert replica_log_seconds(lines, killed_at) == {"first_line": 9.71, "serves": 20.27}
    assert replica_log_seconds([], killed_at) == {"first_line": None, "serves": None}


def test_the_summary_takes_the_median_of_the_kills_that_reached_each_milestone() -> None:
    seconds = [
        {"degraded": 0.3, "process": 3.2, "listed": 21.1, "served": 21.6},
        {"degraded": 0.5, "process": 4.0, "listed": 18.7, "served": 19.2},
        {"degraded": 0.4, "process": 3.6, "listed": None, "served": None},  # timed out
    ]
    kills = [Replacement(victim=i, seconds=s) for i, s in enumerate(seconds)]
    summary = summarize(kills)
    assert summary["median_s"] == {"degraded": 0.4, "process": 3.6, "listed": 19.9, "served": 20.4}
    text = markdown(summary)
    assert "| 3 | 0.40 | 3.60 | - | - | - | - |" in text
    assert "| median | 0.40 | 3.60 | 19.90 | 20.40 | | |" in text
