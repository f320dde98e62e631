"""serve/builder.py on a real local Ray with Serve, no Ray Serve LLM: a study's builder that does not answer within
BUILD_TIMEOUT_S (here a builder that sleeps far past a tiny bound) leaves the trial to build its application itself,
with a warning naming the timeout, and, its build done late, gives Serve nothing: the one application of that name is
the trial's. A trial's own hand-off that Serve takes too late fails the deploy, and what Serve takes after is deleted.
And Serve keeps one application per name, the last given (what a hand-off in flight would race)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from servetune.serve import builder  # noqa: E402

# The slow builder's sleep against the trial's bound: twenty times over.
TIMEOUT_S = 0.5
SLEEP_S = 10.0


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Whose:
    def __init__(self, who: str) -> None:
        self.who = who

    def __call__(self, request: object = None) -> str:
        return self.who


class SlowBuilder(builder.AppBuilder):
    """The study's builder (its ``run``), slow: each build sleeps SLEEP_S first, as one queued behind a hung build or
    given to a Serve that does not answer; its application is this module's, no Ray Serve LLM."""

    def __init__(self) -> None:
        builder.openai_app = lambda config, keep, version: Whose.bind("builder")  # the actor's process only

    def run(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(SLEEP_S)
        return super().run(*args)

    def idle(self) -> bool:
        return True  # answered once the build ahead is done: one at a time


def answer(name: str, timeout_s: float = 60.0) -> str:
    """What the application ``name`` answers, once Serve has it RUNNING."""
    deadline = time.monotonic() + timeout_s
    while not str(getattr(serve.status().applications.get(name), "status", "")).endswith("RUNNING"):
        assert time.monotonic() < deadline, serve.status().applications
        time.sleep(0.2)
    return serve.get_app_handle(name).remote().result(timeout_s=timeout_s)


def test_a_builder_past_the_bound_leaves_the_trial_to_build_and_gives_serve_nothing_late(
    serve_apps, monkeypatch, caplog
):
    slow = ray.remote(num_cpus=0, max_restarts=0)(SlowBuilder).options(name=builder.builder_name()).remote()
    try:
        ray.get(slow.idle.remote())
        monkeypatch.setattr(builder, "BUILD_TIMEOUT_S", TIMEOUT_S)
        monkeypatch.setattr(builder, "openai_app", lambda config, keep, version: Whose.bind("trial"))
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=builder.__name__):
            builder.run_openai_app("t", {"model": "m"}, False, None, "/t", attached=True)
        assert time.monotonic() - started < SLEEP_S  # the timeout fired: the trial did not wait for the build
        assert "did not give t to Serve within" in caplog.text and "timeout" in caplog.text, caplog.text
        assert answer("t") == "trial"
        ray.get(slow.idle.remote())  # the builder's late build is done: dropped, past its caller's deadline
        assert list(serve.status().applications) == ["t"]
        assert answer("t") == "trial"  # not replaced by the builder's late hand-off
    finally:
        ray.kill(slow)


def test_serve_keeps_one_application_per_name_the_last_given(serve_apps):
    """Were a builder's hand-off in flight when its caller gives its own, the later replaces it: one application."""
    builder.send_app("t", Whose.bind("first"), "/t")
    builder.send_app("t", Whose.bind("second"), "/t")
    assert list(serve.status().applications) == ["t"]
    assert answer("t") == "second"


def test_a_hand_off_serve_takes_past_its_bound_fails_the_deploy_and_leaves_nothing_on_serve(serve_apps, monkeypatch):
    """Serve's controller slow to take the application (here Serve's own ``run_many``, called SLEEP_S late): the
    trial's deploy fails at the bound, and the application Serve takes afterwards is deleted, not left running."""
    from servetune.errors import EngineStartError

    run_many = serve.run_many

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(SLEEP_S)
        return run_many(*args, **kwargs)

    monkeypatch.setattr(serve, "run_many", slow)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="Serve did not take the application t within"):
        builder.send_app("t", Whose.bind("given up"), "/t", timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < SLEEP_S
    for thread in [t for t in threading.enumerate() if t.name == builder.HANDOFF_THREAD + "t"]:
        thread.join(SLEEP_S + 60)  # Serve took it late, and the hand-off deleted it
    deadline = time.monotonic() + 60
    while "t" in serve.status().applications:
        assert time.monotonic() < deadline, serve.status().applications
        time.sleep(0.2)
