"""A test's Ray head (tests/ray_heads.py) whose ``ray start`` exits on Ray's start timing out is stopped and started
again, at most START_TRIES times; any other exit fails the test at once. Without Ray: the start, the wait and the
stop are stand-ins."""

from pathlib import Path

import pytest

from tests import ray_heads

TIMED_OUT = "Exception: The current node timed out during startup. This could happen because some of the raylet ..."
CLIENT_SERVER_GONE = "Some Ray subprocesses exited unexpectedly:\n  ray_client_server [exit code=1]"


class Proc:
    returncode = 1


@pytest.fixture
def heads(monkeypatch):
    """Each start's outcome in turn (None: the head answers); what was started and stopped."""
    seen: dict[str, list] = {"outcomes": [], "started": [], "stopped": []}

    def start(env, num_cpus, num_gpus):
        head = f"head{len(seen['started']) + 1}"
        seen["started"].append(head)
        return Proc(), head

    monkeypatch.setattr(ray_heads, "_start_head", start)
    monkeypatch.setattr(ray_heads, "_wait_for_head", lambda proc, head: seen["outcomes"].pop(0))
    monkeypatch.setattr(ray_heads, "_stop_head", lambda proc, head: seen["stopped"].append(head))
    return seen


@pytest.mark.parametrize("exited", [TIMED_OUT, CLIENT_SERVER_GONE])
def test_a_head_that_timed_out_while_starting_is_stopped_and_started_again(heads, exited, capsys):
    heads["outcomes"] += [exited, None]
    with ray_heads.ray_head({}) as head:
        assert head == "head2" and heads["stopped"] == ["head1"]
    assert heads["stopped"] == ["head1", "head2"]
    assert "timed out while starting (try 1 of 3); stopped, starting it again" in capsys.readouterr().err


def test_a_head_that_keeps_timing_out_fails_after_its_tries(heads):
    heads["outcomes"] += [TIMED_OUT] * ray_heads.START_TRIES
    tries = f"try {ray_heads.START_TRIES} of {ray_heads.START_TRIES}"
    with pytest.raises(pytest.fail.Exception, match=tries), ray_heads.ray_head({}):
        pass
    assert heads["stopped"] == heads["started"] and len(heads["started"]) == ray_heads.START_TRIES


def test_a_head_that_exited_for_another_reason_fails_at_once(heads):
    heads["outcomes"] += ["ValueError: Invalid --resources", None]
    with pytest.raises(pytest.fail.Exception, match="Invalid --resources"), ray_heads.ray_head({}):
        pass
    assert heads["started"] == heads["stopped"] == ["head1"]


class Worker:
    """A worker's ``ray start --address --block``: exited (``returncode``) or still running (None)."""

    def __init__(self, returncode):
        self.returncode = returncode

    def poll(self):
        return self.returncode


@pytest.fixture
def workers(monkeypatch, tmp_path):
    """A stand-in head, and each worker start's outcome in turn (None: it joins; text: it exited saying so)."""
    from contextlib import contextmanager

    seen: dict[str, list] = {"outcomes": [], "started": [], "stopped": []}

    @contextmanager
    def head(env, num_cpus, num_gpus):
        yield ray_heads.RayHead.__new__(ray_heads.RayHead)

    def start(head, env, num_cpus, num_gpus, resources=None, ip="127.0.0.1", proxy_port=None):
        temp_dir = tmp_path / f"worker{len(seen['started']) + 1}"
        temp_dir.mkdir()
        exited = seen["outcomes"].pop(0)
        (temp_dir / "ray-start.log").write_text(exited or "")
        seen["started"].append((temp_dir.name, num_cpus, resources))
        return ray_heads.RayNode(Worker(None if exited is None else 1), temp_dir, num_cpus, num_gpus, ip)  # type: ignore[arg-type]

    monkeypatch.setattr(ray_heads, "ray_head", head)
    monkeypatch.setattr(ray_heads, "_start_worker", start)
    monkeypatch.setattr(ray_heads.time, "sleep", lambda s: None)
    monkeypatch.setattr(ray_heads, "stop_process_tree", lambda proc, marker: seen["stopped"].append(Path(marker).name))
    # The head and every worker still running have joined.
    monkeypatch.setattr(ray_heads.LocalCluster, "nodes",
                        lambda self: [{}] + [{} for w in self.workers if w.proc.poll() is None])  # fmt: skip
    return seen


def test_a_worker_that_timed_out_joining_is_stopped_and_started_again_as_it_was(workers, capsys):
    workers["outcomes"] += [None, TIMED_OUT, None]
    with ray_heads.ray_cluster(
        {}, [(2, 2, {"accelerator_type:H100": 1.0}), (3, 1, {"accelerator_type:A100": 1.0})]
    ) as c:
        assert [w.temp_dir.name for w in c.workers] == ["worker1", "worker3"] and workers["stopped"] == ["worker2"]
    assert workers["started"][2] == ("worker3", 3, {"accelerator_type:A100": 1.0})  # the same worker, afresh
    assert "ray start --address timed out while starting (try 1 of 3)" in capsys.readouterr().err


def test_a_worker_that_exited_for_another_reason_fails_at_once(workers):
    workers["outcomes"] += ["ValueError: Invalid --resources"]
    with pytest.raises(pytest.fail.Exception, match="Invalid --resources"), ray_heads.ray_cluster({}, [(2, 2)]):
        pass
    assert len(workers["started"]) == 1
