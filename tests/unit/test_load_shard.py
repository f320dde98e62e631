"""The load client split across processes (load/shard.py, ``load.client_processes``), against the fake server."""

from __future__ import annotations

import asyncio

import numpy as np
import psutil
import pytest

from servetune.config.settings import LoadProtocol
from servetune.config.workload import Sessions, Workload
from servetune.errors import UserError
from servetune.load.client import StreamingClient
from servetune.load.pace import ClientPace, client_bound, shards_bound
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level
from servetune.load.shard import (
    ClientSettings,
    ClientShardError,
    auto_client_processes,
    open_schedule,
    plan_shards,
    run_sharded,
    shard_count,
    split_evenly,
)
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.measure import LevelPlan, client_shards
from tests.conftest import serve_fake
from tests.unit.test_space import space


def specs(n: int, output_tokens: int = 6) -> list[RequestSpec]:
    return [RequestSpec(i, "hello " * 4, 4, output_tokens, "c") for i in range(n)]


def in_flight_peak(records) -> int:
    """The most requests the client had in flight at once, from the records' send and end times."""
    events = sorted([(r.sent, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    return max(np.cumsum([step for _, step in events]))


def test_the_split_covers_every_request_once_and_keeps_the_levels_concurrency_and_cap():
    requests = specs(23)
    closed = plan_shards(Level("concurrency", 5), requests, 2, seed=1)
    assert [p.level.value for p in closed] == [3.0, 2.0]  # the clients split, adding up to the level's
    assert sorted(i for p in closed for i in p.indices) == list(range(23))
    for plan in closed:  # a shard holds its clients' requests, in level order
        assert all((i % 5) % 2 == plan.shard for i in plan.indices)
        assert [s.index for s in plan.specs] == list(plan.indices) and plan.schedule is None
    capped = Level("rate", 10.0, "poisson", max_concurrency=7)
    opened = plan_shards(capped, requests, 3, seed=1)
    assert [p.level.max_concurrency for p in opened] == [3, 2, 2]
    assert [p.indices for p in opened] == [tuple(range(k, 23, 3)) for k in range(3)]
    whole = open_schedule(capped, 23, 1)
    merged = sorted((i, t) for p in opened for i, t in zip(p.indices, p.schedule or (), strict=True))
    assert [t for _, t in merged] == whole  # the shards' times are the one schedule's
    assert sum(split_evenly(17, 4)) == 17 and max(split_evenly(17, 4)) - min(split_evenly(17, 4)) == 1
    assert shard_count(Level("concurrency", 2), 100, 8) == 2  # no shard without a client
    assert shard_count(capped, 100, 8) == 7 and shard_count(Level("rate", 5.0), 3, 8) == 3
    with pytest.raises(ValueError, match="conversations"):
        plan_shards(Level("rate", 1.0), [RequestSpec(0, "x", 1, 1, "c", session=0)], 2, seed=0)


def test_an_open_loop_across_two_processes_sends_the_unsharded_schedule():
    level, n, warmup = Level("rate", 150.0, "poisson"), 36, 4

    async def alone(url: str):
        async with StreamingClient(url, "fake") as client:
            return await run_level(client, specs(n), level, num_requests=n - warmup, warmup_requests=warmup, seed=9)

    done = []
    with serve_fake(FakeOpenAI(ttft_ms=2.0, itl_ms=1.0)) as url:
        single = asyncio.run(alone(url))
        run = asyncio.run(
            run_sharded(
                ClientSettings(url, "fake"), specs(n), level, 2, warmup_requests=warmup, seed=9, on_done=done.append
            )
        )
    assert len(run.records) == len(single) == n and all(r.ok for r in run.records)
    assert [r.index for r in run.records] == [r.index for r in single] == list(range(n))
    assert [r.warmup for r in run.records] == [r.warmup for r in single]
    assert sorted(r.index for r in done) == list(range(n))  # every record was handed on as it finished
    # The same schedule: the unsharded one counts from its first send, a few µs after its origin.
    sharded = np.array([r.scheduled for r in run.records])
    unsharded = np.array([r.scheduled for r in single])
    assert np.allclose(sharded, unsharded - unsharded[0], atol=1e-9)
    assert np.allclose(sharded, open_schedule(level, n, 9))
    assert run.pace.send_lag_ms_p50 is not None and len(run.shard_paces) == 2
    assert all(p.cpu_share is not None and 0 < p.cpu_share < 1 for p in run.shard_paces)


def test_a_closed_loop_across_two_processes_keeps_the_levels_concurrency():
    level, n = Level("concurrency", 5), 30
    with serve_fake(FakeOpenAI(ttft_ms=5.0, itl_ms=3.0)) as url:
        run = asyncio.run(
            run_sharded(ClientSettings(url, "fake"), specs(n, 8), level, 2, warmup_requests=5, stagger=False)
        )
    assert len(run.records) == n and all(r.ok for r in run.records)
    assert sum(r.warmup for r in run.records) == 5 and all(r.warmup for r in run.records[:5])
    # the shards' clients add up to the level's: at most 5 in flight, and all 5 at once (no stagger)
    assert in_flight_peak(run.records) == 5
    assert run.pace.send_lag_ms_p50 is None  # a closed loop has no schedule


def test_the_early_break_stops_every_shard():
    level, n = Level("concurrency", 4), 200
    finished = []
    with serve_fake(FakeOpenAI(ttft_ms=2.0, itl_ms=2.0)) as url:
        run = asyncio.run(
            run_sharded(
                ClientSettings(url, "fake"),
                specs(n, 4),
                level,
                2,
                on_done=finished.append,
                stop=lambda: len(finished) >= 12,
            )
        )
    assert 12 <= len(run.records) < n  # what was in flight finished; nothing more was sent


def test_a_killed_shard_fails_the_level_in_one_line_and_leaves_no_process():
    level, n = Level("concurrency", 4), 40
    shards: list[psutil.Process] = []

    def kill_one(_t0: float) -> None:  # once the shards are running: SIGKILL the first
        shards.extend(psutil.Process().children())
        shards[0].kill()

    with serve_fake(FakeOpenAI(ttft_ms=20.0, itl_ms=20.0)) as url, pytest.raises(ClientShardError) as info:
        asyncio.run(run_sharded(ClientSettings(url, "fake"), specs(n, 50), level, 2, on_start=kill_one))
    message = str(info.value)
    assert "shard" in message and "died" in message and "exit code -9" in message and "\n" not in message
    assert len(shards) == 2
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in shards)
    assert not psutil.Process().children(recursive=True)


def test_any_shard_behind_makes_the_level_client_bound():
    kept = ClientPace(0.2, 3.0, 9.0)
    behind = ClientPace(0.95, 4.0, 9.0)
    assert shards_bound([kept, kept]) is None
    why = shards_bound([kept, behind])
    assert why is not None and why.startswith("shard 2 of 2:") and "95%" in why
    assert shards_bound([behind]) == client_bound(behind)


def test_auto_sizes_from_the_expected_token_rate_within_the_trials_cpus():
    assert auto_client_processes(Level("rate", 2.0), 256, cpus=8) == 1
    busy = Level("rate", 600.0)  # 600 req/s x 256 tokens: 153,600 chunks/s
    assert auto_client_processes(busy, 256, cpus=8, rated=60_000) == 3
    assert auto_client_processes(busy, 256, cpus=2, rated=60_000) == 2  # no more than the cores reserved
    assert auto_client_processes(Level("concurrency", 1024), 256, cpus=8, rated=60_000) == 2


def test_a_level_that_cannot_be_split_is_refused_or_kept_whole():
    fixed = {"dist": "fixed", "value": 8}
    plain = Workload.model_validate({"name": "w", "input_tokens": fixed, "output_tokens": fixed})
    chat = plain.model_copy(update={"sessions": Sessions.model_validate({"turns": {"dist": "fixed", "value": 2}})})
    plan = LevelPlan(Level("rate", 1000.0), 100, None, 0)
    assert client_shards(chat, plan, "auto", 8) == 1
    with pytest.raises(UserError, match=r"^load.client_processes: 2 cannot split conversations"):
        client_shards(chat, plan, 2, 8)
    timed = LevelPlan(Level("rate", 1.0), None, 10.0, 0)
    with pytest.raises(UserError, match="bounded by time alone"):
        client_shards(plain, timed, 2, 8)
    assert client_shards(plain, plan, 3, 1) == 3  # a number is the user's


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", "true"])
def test_a_bad_client_processes_is_one_line_naming_file_and_field(tmp_path, value):
    with pytest.raises(UserError) as info:
        space(tmp_path, f"load: {{client_processes: {value}}}\n")
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")) and "load.client_processes" in message, message
    assert "\n" not in message


def test_client_processes_defaults_to_one_and_takes_auto():
    assert LoadProtocol().client_processes == 1
    assert LoadProtocol(client_processes="auto").client_processes == "auto"
    assert LoadProtocol(client_processes=4).client_processes == 4


def test_a_shard_imports_the_servetune_this_process_runs_from_a_trials_own_directory(tmp_path, monkeypatch):
    """A job's runtime env sets ``PYTHONPATH: src`` (cluster/runtime_env.yaml) and a trial runs in its own Tune
    directory: a shard started with the relative entry would import whatever servetune the node has installed."""
    import sys
    from pathlib import Path

    import servetune

    src = str(Path(servetune.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", "src")
    monkeypatch.setattr(sys, "path", [src, *sys.path])  # as Python resolved the entry in the job's directory
    monkeypatch.chdir(tmp_path)  # the trial's own: no src/ here
    seen: list[str | None] = []

    def look(_t0: float) -> None:
        shards = [p for p in psutil.Process().children() if "servetune.load.shard" in p.cmdline()]
        seen.extend(p.environ().get("PYTHONPATH") for p in shards)

    with serve_fake(FakeOpenAI(ttft_ms=2.0, itl_ms=1.0)) as url:
        run = asyncio.run(run_sharded(ClientSettings(url, "fake"), specs(8), Level("concurrency", 2), 2, on_start=look))
    assert len(run.records) == 8 and all(r.ok for r in run.records)
    assert seen == [src, src]
