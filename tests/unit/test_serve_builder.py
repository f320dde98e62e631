"""serve/builder.py: a study's trial hands its application to the study's builder actor (which imported Ray Serve LLM
once) rather than importing Ray Serve LLM and vLLM in its own fresh worker to build it; where none runs, or it died,
or it did not answer within BUILD_TIMEOUT_S, the trial builds it itself, and the builder drops a build its caller
stopped waiting for. The builder is named after the driver's job and held by the driver until it exits. Ray's
calls are replaced; tests/integration/test_serve_builder_ray.py runs a slow builder on a real Ray and Serve,
tests/e2e/test_serve_trials_vllm_cpu.py the builder for real."""

import subprocess
import sys
import threading
import time
import types

import pytest

pytest.importorskip("ray.serve")

from servetune.serve import builder
from servetune.serve.cluster import ServeCluster

JOB = "02000000"


class FakeBuilder:
    def __init__(self, calls, dead=False):
        self.calls, self.dead = calls, dead
        self.run = self

    def remote(self, *args):
        if self.dead:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        *sent, deadline, delete_late = args  # the wall clock past which the builder drops the build (AppBuilder.run)
        assert delete_late is True  # a deploy: what Serve takes after it was given up is deleted
        assert deadline == pytest.approx(time.time() + builder.BUILD_TIMEOUT_S, abs=5)
        self.calls.append(("builder", *sent))
        return 0.25  # the seconds Serve took, as the builder's send_app says


@pytest.fixture
def recorded(monkeypatch):
    """What was built where: ('builder', ...) by the study's builder, ('here', ...) in this process."""
    calls: list[tuple] = []
    monkeypatch.setattr(builder, "openai_app", lambda config, keep, version: ("app", config["name"], keep, version))

    def send_here(name, app, prefix, delete_late=True):
        calls.append(("here", name, app, prefix))
        return 0.5

    monkeypatch.setattr(builder, "send_app", send_here)
    monkeypatch.setattr("ray.get", lambda ref, timeout=None: ref)
    monkeypatch.setattr("ray.get_runtime_context", lambda: types.SimpleNamespace(get_job_id=lambda: JOB))
    return calls


def test_a_trial_on_a_study_cluster_hands_its_application_to_its_driver_s_builder(monkeypatch, recorded):
    def get_actor(name):
        if name != builder.BUILDER_PREFIX + JOB:  # the builder of this process's job (its study's driver), no other
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return FakeBuilder(recorded)

    monkeypatch.setattr("ray.get_actor", get_actor)
    sent_s = builder.run_openai_app("servetune-s-1", {"name": "c"}, True, "v1", "/servetune-s-1", attached=True)
    assert recorded == [("builder", "servetune-s-1", {"name": "c"}, True, "v1", "/servetune-s-1")]
    assert sent_s == 0.25  # what Serve took to take it, as the builder timed it


@pytest.mark.parametrize("builder_state", ["none", "dead"])
def test_without_a_live_builder_the_trial_builds_it_itself(monkeypatch, recorded, builder_state, caplog):
    def get_actor(name):
        if builder_state == "none":
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return FakeBuilder(recorded, dead=True)

    monkeypatch.setattr("ray.get_actor", get_actor)
    assert builder.run_openai_app("servetune-s-1", {"name": "c"}, False, None, "/x", attached=True) == 0.5
    assert recorded == [("here", "servetune-s-1", ("app", "c", False, None), "/x")]
    # a builder that died is said; none at all is a driver without one (nothing to say)
    assert ("builder is gone" in caplog.text) == (builder_state == "dead"), caplog.text


def test_a_build_that_fails_in_the_builder_fails_the_trial_and_is_not_built_again(monkeypatch, recorded):
    class Refused(Exception):
        pass

    def refused(
        ref, timeout=None
    ):  # as Ray raises a remote error: its cause's class and Ray's, Ray's traceback as its text
        from ray.exceptions import RayTaskError

        cause = Refused("engine_kwargs: no such argument")
        raise RayTaskError(
            "AppBuilder.run", "Traceback: ...", cause, "ray::AppBuilder", 1, "127.0.0.1"
        ).as_instanceof_cause()

    monkeypatch.setattr("ray.get_actor", lambda name: FakeBuilder(recorded))
    monkeypatch.setattr("ray.get", refused)
    with pytest.raises(Refused) as raised:
        builder.run_openai_app("servetune-s-1", {"name": "c"}, False, None, "/x", attached=True)
    assert str(raised.value) == "engine_kwargs: no such argument"  # the trial's reason: the build's words, not Ray's
    assert [call[0] for call in recorded] == ["builder"]


@pytest.mark.parametrize("answer", ["none in time", "dropped"])
def test_a_builder_that_does_not_build_it_in_time_leaves_the_trial_to_build_it_itself(
    monkeypatch, recorded, caplog, answer
):
    """Serve not answering the builder, or builds queued ahead of this one: the trial waits BUILD_TIMEOUT_S, no longer,
    then builds the application itself and says why; as it does where the builder answers that it dropped the build
    (its clock past the trial's deadline)."""
    from ray.exceptions import GetTimeoutError

    waited = []

    def get(ref, timeout=None):
        waited.append(timeout)
        if timeout is None:
            pytest.fail("waited for the builder without a bound")
        if answer == "dropped":
            return None
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr("ray.get_actor", lambda name: FakeBuilder(recorded))
    monkeypatch.setattr("ray.get", get)
    assert builder.run_openai_app("servetune-s-1", {"name": "c"}, False, None, "/x", attached=True) == 0.5
    assert waited == [builder.BUILD_TIMEOUT_S]
    assert [call[0] for call in recorded] == ["builder", "here"]  # asked, then built here
    assert f"did not give servetune-s-1 to Serve within {builder.BUILD_TIMEOUT_S:.0f} s" in caplog.text, caplog.text
    assert "timeout" in caplog.text and "built here" in caplog.text


@pytest.mark.parametrize(
    ("left_s", "late"), [(2 * builder.SEND_MARGIN_S, False), (-60.0, True), (builder.SEND_MARGIN_S / 3, True)]
)
def test_the_builder_drops_a_build_whose_caller_stopped_waiting(monkeypatch, left_s, late):
    """Past the deadline its caller gave (its caller builds it itself), or so near it that the hand-off could land
    after the caller's own, the builder gives Serve nothing: a late hand-off of the same name would replace the
    application its caller gave Serve."""
    sent = []
    monkeypatch.setattr(builder, "openai_app", lambda config, keep, version: ("app", config["name"]))
    monkeypatch.setattr(builder, "send_app", lambda name, app, prefix, **kw: sent.append((name, app, prefix)) or 0.5)
    actor = object.__new__(builder.AppBuilder)  # its __init__ imports Ray Serve LLM, which this does not need
    deadline = time.time() + left_s
    answer = actor.run("servetune-s-1", {"name": "c"}, False, None, "/x", deadline)
    assert (answer, sent) == ((None, []) if late else (0.5, [("servetune-s-1", ("app", "c"), "/x")]))


def test_a_driver_of_its_own_builds_here_and_looks_for_no_builder(monkeypatch, recorded):
    """serve-check and verify's own Ray: their driver builds (it imports Ray Serve LLM once either way)."""
    monkeypatch.setattr("ray.get_actor", lambda name: pytest.fail("looked for a builder"))
    builder.run_openai_app("check", {"name": "c"}, True, "v", "/", attached=False)
    assert recorded == [("here", "check", ("app", "c", True, "v"), "/")]


def test_the_builder_is_the_driver_s_named_after_its_job_and_held_until_it_exits(monkeypatch):
    """Not detached (Ray stops it with its driver), named after the job (trials find it, no other study's driver
    does), its handle held (Ray stops a named actor no handle refers to) and stopped at exit."""
    import ray

    started, exits, killed = [], [], []

    class Remote:
        def options(self, **options):
            started.append(options)
            return types.SimpleNamespace(remote=lambda: "handle")

    monkeypatch.setattr(ray, "remote", lambda **options: lambda cls: started.append((cls, options)) or Remote())
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_job_id=lambda: JOB))
    monkeypatch.setattr(builder.atexit, "register", lambda fn, *args: exits.append((fn, args)))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", killed.append)
    assert builder.start_builder() == "handle"
    (cls, remote_options), options = started
    assert cls is builder.AppBuilder and remote_options["num_cpus"] == 0 and remote_options["max_restarts"] == 0
    assert options["name"] == builder.BUILDER_PREFIX + JOB and options.get("lifetime") in (None, "non_detached")
    assert exits == [(builder.stop_builder, ("handle",))]
    fn, args = exits[0]
    fn(*args)
    assert killed == ["handle"]


def test_an_attached_cluster_deploys_through_the_builder_and_a_driver_cluster_does_not(monkeypatch):
    import ray
    import ray.serve

    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:6379"))
    monkeypatch.setattr("servetune.serve.cluster._ingress_url", lambda address: "http://127.0.0.1:8000")
    seen = []
    monkeypatch.setattr(
        "servetune.serve.cluster.run_openai_app",
        lambda *args, attached, delete_late: seen.append((attached, delete_late)) or 0.0,
    )
    monkeypatch.setattr("servetune.serve.cluster.time.sleep", lambda s: None)
    up = types.SimpleNamespace(status="RUNNING", deployments={})
    monkeypatch.setattr(ray.serve, "status", lambda: types.SimpleNamespace(applications={"t": up}))
    attached = ServeCluster.attached()
    attached.deploy("t", {"model": "m"}, timeout_s=5)
    attached.redeploy("t", {"model": "m"})
    own = ServeCluster(None, {"CPU": 1})
    own.serving = True
    own.deploy("t", {"model": "m"}, timeout_s=5)
    # A rollout (redeploy) Serve takes after its hand-off was given up is not deleted: a deploy's is.
    assert seen == [(True, True), (True, False), (False, True)]


def test_a_deploy_s_clock_starts_when_serve_is_given_the_application_not_when_it_was_built(monkeypatch):
    """A trial's startup_s is Serve's: the seconds building the application (or waiting for the builder) before
    Serve had it are not in it; those Serve took to take it are, as before the builder."""
    import ray.serve

    clock = [100.0]
    monkeypatch.setattr("servetune.serve.cluster.time.monotonic", lambda: clock[0])

    def built_slowly(*args, attached, delete_late):
        clock[0] += 30.0  # the builder imported Ray Serve LLM meanwhile, then built
        return 2.0  # of which Serve's run_many took 2 s

    def sleep(s):
        clock[0] += s

    monkeypatch.setattr("servetune.serve.cluster.run_openai_app", built_slowly)
    monkeypatch.setattr("servetune.serve.cluster.time.sleep", sleep)
    up = types.SimpleNamespace(status="RUNNING", deployments={})
    monkeypatch.setattr(ray.serve, "status", lambda: types.SimpleNamespace(applications={"t": up}))
    cluster = ServeCluster(None, {"CPU": 1})
    cluster.serving = True
    assert cluster.deploy("t", {"model": "m"}, timeout_s=5) == pytest.approx(2.0 + 1.0)  # run_many, the first read


def test_building_the_study_s_application_in_the_builder_keeps_ray_serve_llm_out_of_the_caller():
    """The modules a trial's deploy goes through import nothing of Ray Serve LLM (nor vLLM) until it builds here."""
    code = ("import sys, servetune.serve.builder, servetune.serve.cluster, servetune.serve.trial; "
            "print(sorted(m for m in ('ray.serve.llm', 'vllm', 'torch') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.fixture
def stuck_serve(monkeypatch):
    """Serve's ``run_many`` held until the test lets it go (a controller not answering); what is deleted."""
    import ray.serve

    release, deleted = threading.Event(), []

    def run_many(targets, wait_for_applications_running):
        release.wait(60)

    monkeypatch.setattr(ray.serve, "run_many", run_many)
    monkeypatch.setattr(ray.serve, "delete", lambda name, _blocking=True: deleted.append(name))
    yield release, deleted
    release.set()  # and its hand-offs ended while Serve's calls are still replaced: none reaches a real Serve later
    for thread in threading.enumerate():
        if thread.name.startswith(builder.HANDOFF_THREAD):
            thread.join(10)


def test_a_hand_off_serve_does_not_take_in_time_fails_the_deploy_and_what_it_takes_later_is_deleted(stuck_serve):
    """A trial's own hand-off (the builder's fallback) is bounded: a stuck Serve fails the deploy, not hangs it; and
    should Serve take the application after all, the hand-off deletes it: a deploy given up leaves nothing on Serve."""
    from servetune.errors import EngineStartError

    release, deleted = stuck_serve
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="Serve did not take the application servetune-s-1 within"):
        builder.send_app("servetune-s-1", object(), "/servetune-s-1", timeout_s=0.2)
    assert time.monotonic() - started < 30  # the bound, not the stuck call, ended the wait
    assert builder.handoffs_in_flight() == ["servetune-s-1"] and deleted == []
    release.set()  # Serve takes it, late
    for thread in threading.enumerate():
        if thread.name.startswith(builder.HANDOFF_THREAD):
            thread.join(10)
    assert deleted == ["servetune-s-1"] and builder.handoffs_in_flight() == []


def test_a_hand_off_taken_in_time_stays_and_one_serve_refuses_fails_as_serve_said(monkeypatch):
    import ray.serve

    deleted, given = [], []
    monkeypatch.setattr(ray.serve, "delete", lambda name, _blocking=True: deleted.append(name))
    monkeypatch.setattr(ray.serve, "run_many", lambda targets, wait_for_applications_running: given.extend(targets))
    assert builder.send_app("t", object(), "/t", timeout_s=10) >= 0
    assert [(t.name, t.route_prefix) for t in given] == [("t", "/t")] and deleted == []

    def refused(targets, wait_for_applications_running):
        raise ValueError("route_prefix: taken")

    monkeypatch.setattr(ray.serve, "run_many", refused)
    with pytest.raises(ValueError, match="route_prefix: taken"):
        builder.send_app("t", object(), "/t", timeout_s=10)
    assert deleted == []


def test_the_builder_gives_serve_nothing_while_a_hand_off_it_gave_up_is_in_flight(monkeypatch, stuck_serve, caplog):
    """One ``serve.run_many`` at a time in the builder: while one it gave up is in flight it gives Serve nothing (None,
    said why), and its caller builds and hands off its own, bounded, rather than every later trial failing behind one
    stuck call."""
    from servetune.errors import EngineStartError

    with pytest.raises(EngineStartError):
        builder.send_app("servetune-s-1", object(), "/servetune-s-1", timeout_s=0.1)
    sent = []
    monkeypatch.setattr(builder, "openai_app", lambda config, keep, version: ("app", config["name"]))
    monkeypatch.setattr(builder, "send_app", lambda name, app, prefix, **kw: sent.append(name) or 0.5)
    actor = object.__new__(builder.AppBuilder)
    assert actor.run("servetune-s-2", {"name": "c"}, False, None, "/x", time.time() + 2 * builder.SEND_MARGIN_S) is None
    assert sent == [] and "Serve has not taken servetune-s-1 since its hand-off was given up" in caplog.text


def test_an_update_serve_takes_late_is_not_deleted_and_a_hand_off_still_in_flight_at_exit_is(stuck_serve, caplog):
    """A rollout's hand-off (``delete_late=False``) Serve takes after it was given up stays: deleting it would take
    the running application down. A deploy's hand-off still not taken when the process exits (its thread, a daemon,
    dies with it) is deleted at exit, as Serve may take it later (on a cluster, with its GPUs)."""
    from servetune.errors import EngineStartError

    release, deleted = stuck_serve
    with pytest.raises(EngineStartError, match="Serve may still apply it"):
        builder.send_app("running", object(), "/running", timeout_s=0.1, delete_late=False)
    with pytest.raises(EngineStartError, match="it is deleted should Serve take it later"):
        builder.send_app("servetune-s-3", object(), "/servetune-s-3", timeout_s=0.1)
    # A retry of the trial (the cluster's failure is retried) gives Serve nothing while the first is in flight: its
    # late end would delete what the retry gave.
    with pytest.raises(EngineStartError, match="an earlier hand-off of it, given up, is still in flight"):
        builder.send_app("servetune-s-3", object(), "/servetune-s-3", timeout_s=0.1)
    builder._settle_handoffs(wait_s=0.2)  # as at exit: neither taken yet
    assert deleted == ["servetune-s-3"]
    release.set()  # Serve takes both, late: the deploy's deleted (again: nothing of it stays), the update's not
    for thread in threading.enumerate():
        if thread.name.startswith(builder.HANDOFF_THREAD):
            thread.join(10)
    assert deleted == ["servetune-s-3", "servetune-s-3"] and "Serve took the update of running" in caplog.text


def test_a_hand_off_serve_did_not_take_is_the_clusters_failure_not_the_configurations():
    from servetune.trial.failures import classify

    reason = f"engine start: {builder.NOT_TAKEN} servetune-t-1 within 60 s (SEND_TIMEOUT_S, a timeout): given up"
    failure = classify(reason)
    assert failure.kind == "infrastructure" and failure.cause == "serve_handoff" and failure.retry_after_s
