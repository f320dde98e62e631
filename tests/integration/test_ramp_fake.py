"""The ramp's driver over real HTTP against the fake OpenAI server: the clients in flight follow
the phases, 3x waits until the watched deployment has scaled out, and the records and samples
come back summarized. Serve is a stand-in here (``Watch``); tests/e2e runs the same ramp on
Ray Serve with real vLLM."""

from __future__ import annotations

import asyncio
import time

from servetune.config.workload import load_workload
from servetune.load.requests import PromptFactory
from servetune.load.tokenizer import load_tokenizer
from servetune.serve.ramp import ramp_phases, run_ramp
from servetune.testing.fake_openai import FakeOpenAI
from tests.conftest import serve_fake


class Watch:
    """A deployment that starts a second replica 1.5 s after it first sees more than 4 requests in flight."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        self.busy_since: float | None = None
        self.peak_in_flight = 0

    def replica_states(self, name: str) -> dict[str, int]:
        in_flight = self.fake.running + self.fake.waiting
        self.peak_in_flight = max(self.peak_in_flight, in_flight)
        if self.busy_since is None and in_flight > 4:
            self.busy_since = time.monotonic()
        scaled = self.busy_since is not None and time.monotonic() - self.busy_since > 1.5
        return {"RUNNING": 2 if scaled else 1, **({} if scaled or self.busy_since is None else {"STARTING": 1})}

    def served_per_replica(self, name: str) -> dict[str, int]:
        done = self.fake.finished
        return (
            {"a": done} if self.busy_since is None or time.monotonic() - self.busy_since < 2.5 else {"a": done, "b": 1}
        )


def test_the_ramp_follows_its_phases_and_waits_for_the_scale_out(tiny_model):
    fake = FakeOpenAI(ttft_ms=30, itl_ms=2)
    watch = Watch(fake)
    phases = ramp_phases(2, max_replicas=2, hold_s=1.0)
    with serve_fake(fake) as url:
        summary, samples, records, phase_of = asyncio.run(run_ramp(
            watch, "app", url, "fake", load_workload("cpu-tiny"), PromptFactory(load_tokenizer(str(tiny_model))),
            phases, {"ttft_ms": 5000}, request_timeout_s=30, scale_up_timeout_s=30,
        ))  # fmt: skip
    # 3x the knee of 2, counted from the clients' own records (the watch's samples, once a second,
    # need not catch all six at once on a loaded host); the server never saw more.
    events = sorted([(r.sent, 1) for r in records] + [(r.end, -1) for r in records if r.end is not None])
    in_flight = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(in_flight) == 6 and watch.peak_in_flight <= 6, (max(in_flight), watch.peak_in_flight)
    assert [p.name for p in summary["phases"]] == ["1x", "3x", "back to 1x"]
    assert all(p.requests > 0 and p.errors == 0 and p.slo_violations == 0 for p in summary["phases"])
    assert summary["replicas_before"] == 1 and summary["replicas_peak"] == 2
    # Not before the watch's 1.5 s; after it, up to a sample (1 s) to see the load and one to see the
    # replica, each stretched on a loaded host: 3.5 s here. Above, only the ramp's own limit: past
    # scale_up_timeout_s (30 s) it stops waiting for the replica, and a scale-out that late is a failure.
    took = summary["time_to_scale_up_s"]
    assert 1.5 <= took < 30.0, (took, [(s.t_s, s.running, s.starting) for s in samples])
    three = summary["phases"][1]
    assert three.end_s - three.start_s >= summary["time_to_scale_up_s"] + 1.0  # held 1 s after the scale-out
    assert summary["new_replicas"] == ["b"] and summary["traffic_before_ready"] is False
    assert len(records) == len(phase_of) == summary["requests"] and samples[-1].phase == "back to 1x"
    assert fake.running == 0  # every client finished its request before the ramp returned


class StartsBetweenReads(Watch):
    """A deployment whose second replica turns RUNNING and takes its first request right after a read of the
    replicas' states: the moment a sample taken states-first (or both side by side) reads as traffic before
    the replica was ready, though it was not."""

    def __init__(self, fake: FakeOpenAI) -> None:
        super().__init__(fake)
        self.up = False

    def replica_states(self, name: str) -> dict[str, int]:
        if self.up:
            return {"RUNNING": 2}
        if self.fake.running + self.fake.waiting > 4:  # the 3x phase: the replica comes up just after this read
            self.up = True
        return {"RUNNING": 1, "STARTING": 1} if self.up else {"RUNNING": 1}

    def served_per_replica(self, name: str) -> dict[str, int]:
        return {"a": self.fake.finished, **({"b": 1} if self.up else {})}


def test_a_replica_that_starts_between_two_reads_is_not_traffic_before_ready(tiny_model):
    fake = FakeOpenAI(ttft_ms=30, itl_ms=2)
    phases = ramp_phases(2, max_replicas=2, hold_s=1.0)
    with serve_fake(fake) as url:
        summary, samples, _, _ = asyncio.run(run_ramp(
            StartsBetweenReads(fake), "app", url, "fake", load_workload("cpu-tiny"),
            PromptFactory(load_tokenizer(str(tiny_model))), phases, {"ttft_ms": 5000}, request_timeout_s=30,
            scale_up_timeout_s=30,
        ))  # fmt: skip
    seen = [(s.t_s, s.running, s.starting, s.served) for s in samples]
    assert summary["new_replicas"] == ["b"] and summary["traffic_before_ready"] is False, seen
    assert summary["new_replica_first_served_s"] >= summary["new_replica_running_s"], seen
