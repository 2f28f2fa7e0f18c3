"""The fault suite: a short, bounded run of the soak (tools/soak) against a real `prefixgate serve`
on the seeded tiny Llama, with a KV pool small enough that long requests force preemptions.

Sixty requests (streaming and not, some cut by the client mid-stream or by an early client
timeout, some long, some hostile bodies) run while the prefixes file is edited six times:
valid, invalid and truncated (written in place in two halves) edits. Afterwards the server
must have answered no 5xx and only OpenAI-shaped errors, leaked no KV block, and listed
exactly the last valid file after every edit, never the half of a truncated one.

The request mix and the edit kinds are drawn from the seed alone, so the tests replay them
with the soak's own functions and compare counts exactly; only what depends on timing (how
many client cuts landed before the answer, how many preemptions) is bounded instead. The
last test checks that the checks have teeth: a server told to poll its file faster than the
soak's pause between the two halves does act on the half file, and the soak must say so.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from tools.soak.config import EditSettings, LoadSettings, ServerSettings, SoakConfig, Target
from tools.soak.edits import edit_plan
from tools.soak.hostile import hostile_cases
from tools.soak.runner import Run, run
from tools.soak.traffic import plan_request

pytestmark = pytest.mark.slow

SEED = 7
NUM_REQUESTS = 60
NUM_EDITS = 6
MAX_MODEL_LEN = 128
# 80 blocks of 4 tokens: a long request (a prompt of at most ~56 tokens + 64 generated) holds
# up to 30 of them, and the pinned prefixes up to 18 (three entries), so two long requests
# with a few short ones cannot all run: the scheduler must preempt. The reload budget (the
# pool minus one max_model_len request, 48 blocks) still fits old and new prefixes together.
SERVER = ServerSettings(
    block_size=4,
    num_kv_blocks=80,
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=8,
    extra_args=("--debug-check-integrity",),  # the engine checks its pool after every step
    ready_timeout_s=60.0,
    stop_timeout_s=45.0,
)
LOAD = LoadSettings(
    duration_s=60.0,  # a bound only: the run ends after NUM_REQUESTS
    max_requests=NUM_REQUESTS,
    concurrency=6,
    disconnect_rate=0.25,
    long_rate=0.3,
    hostile_rate=0.15,
    stream_rate=0.6,
    short_max_tokens=12,
    long_max_tokens=64,
    request_timeout_s=60.0,
)
EDITS = EditSettings(
    interval_s=0.5,
    max_edits=NUM_EDITS,
    invalid_rate=0.3,
    truncated_rate=0.3,
    truncated_pause_s=0.5,  # half the server's 1 s poll interval
    settle_timeout_s=30.0,
)


@pytest.fixture(scope="module")
def soak_run(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    config = SoakConfig(
        server=replace(SERVER, model=str(tiny_llama_path)),
        load=LOAD,
        edits=EDITS,
        seed=SEED,
        work_dir=tmp_path_factory.mktemp("soak"),
        idle_timeout_s=30.0,
    )
    return run(config)


def _target(run_: Run) -> Target:
    """The run's target as the tests rebuild it (keys only matter as "set")."""
    return Target(run_.target_url, "tiny-llama", MAX_MODEL_LEN, "key", "admin-key", None)


def _planned(run_: Run) -> list[str]:
    """The kind of each request the run sent, replayed from the seed."""
    target = _target(run_)
    hostiles = hostile_cases(target)
    return [plan_request(i, SEED, LOAD, target, hostiles).tally_kind for i in range(NUM_REQUESTS)]


def test_no_5xx_and_every_error_is_openai_shaped(soak_run: Run) -> None:
    load = soak_run.result.load
    assert load.requests_sent == NUM_REQUESTS
    assert (load.client_5xx, soak_run.result.server_5xx, load.stream_server_errors) == (0, 0, 0)
    assert (load.non_openai_errors, load.bad_successes) == (0, 0), soak_run.result.problems
    assert (load.transport_errors, load.timed_out) == (0, 0), soak_run.result.problems
    assert load.hostile_unexpected == 0, soak_run.result.problems
    assert soak_run.result.final_request_status == 200


def test_the_mix_is_the_seeds_and_every_stream_ends(soak_run: Run) -> None:
    load = soak_run.result.load
    assert load.by_kind == dict(Counter(_planned(soak_run)))
    assert load.hostile_sent == len(load.hostile_sweep) + load.by_kind["hostile"]
    # Only the client's own early timeouts leave a request without a response.
    assert load.by_status.get("none", 0) == load.nonstream_cut
    assert load.streams_broken == 0, soak_run.result.problems
    assert load.disconnects > 0


def test_every_hostile_body_gets_its_status(soak_run: Run) -> None:
    """The sweep sent every case once before the load (the load repeats some under load);
    each case has exactly one status it must get."""
    cases = {c.kind.removeprefix("hostile:"): c.expect for c in hostile_cases(_target(soak_run))}
    assert soak_run.result.load.hostile_sweep == cases
    # Special-token text in a user message is plain text: answered, not refused.
    assert cases["special_tokens"] == 200
    assert cases["deep_nesting"] == cases["lone_surrogate"] == cases["not_utf8"] == 400


def test_the_pool_ran_dry_and_no_block_leaked(soak_run: Run) -> None:
    result = soak_run.result
    assert result.preemptions > 0
    kv = result.kv
    assert kv.idle and (kv.running, kv.waiting) == (0, 0)
    assert kv.total == SERVER.num_kv_blocks
    assert kv.leaked == 0 and kv.free + kv.pinned == kv.total


def test_every_edit_is_accounted_for_and_no_state_is_lost(soak_run: Run) -> None:
    result = soak_run.result
    planned: Counter[str] = Counter(itertools.islice(edit_plan(EDITS, SEED), NUM_EDITS))
    assert set(planned) == {"valid", "invalid", "truncated"}  # the seed exercises all three
    written_confirmed = {kind: (t.written, t.confirmed) for kind, t in result.edits.items()}
    assert written_confirmed == {kind: (n, n) for kind, n in planned.items()}
    # One check for the initial file, one per edit, one more per truncated edit (the half).
    assert result.state_checks == 1 + NUM_EDITS + planned["truncated"]
    assert (result.lost_states, result.half_file_seen) == (0, 0), result.problems
    # Every truncated edit watched at least one entry by its hit count: the check had teeth.
    assert result.sentinels_armed >= planned["truncated"]


def test_the_run_passes_and_the_server_stopped_cleanly(soak_run: Run) -> None:
    assert soak_run.result.failures() == []
    assert (soak_run.result.server_exit_code, soak_run.result.server_was_killed) == (0, False)
    assert soak_run.result.server_tracebacks == 0


def test_a_server_acting_on_half_written_files_is_caught(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Polled every 0.1 s, the half file reads the same on two polls within the 0.5 s pause:
    the server loads it (as it should, it cannot know better), and the soak must report it."""
    config = SoakConfig(
        server=ServerSettings(
            model=str(tiny_llama_path),
            block_size=4,
            num_kv_blocks=80,
            max_model_len=MAX_MODEL_LEN,
            extra_args=("--prefix-watch-interval", "0.1"),
            ready_timeout_s=60.0,
        ),
        load=LoadSettings(duration_s=30.0, max_requests=2, hostile_rate=0.0, long_rate=0.0),
        edits=EditSettings(
            interval_s=0.2,
            max_edits=3,
            invalid_rate=0.0,
            truncated_rate=1.0,
            truncated_pause_s=0.5,
            settle_timeout_s=15.0,
        ),
        seed=SEED,
        work_dir=tmp_path_factory.mktemp("soak-half"),
        idle_timeout_s=30.0,
    )
    assert list(itertools.islice(edit_plan(config.edits, SEED), 3)) == [
        "valid",
        "truncated",
        "truncated",
    ]
    result = run(config).result
    assert result.edits["truncated"].written == result.edits["truncated"].confirmed == 2
    assert (result.half_file_seen, result.lost_states) == (2, 2), result.problems
    assert result.failures() == ["lost registry states: 2"]
