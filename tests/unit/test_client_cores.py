"""Where a load client runs beside a CPU engine (engine/cores.py ``client_cores``, ``pinned_to``): on the cores the
engine's OpenMP ranks are not bound to, a whole physical core apart where there is one, off other engines' cores where
others are left; left where it is (and why) for an engine bound to no known cores or to every core."""

import fcntl
import os
import threading

import pytest

from servetune.engine import cores
from servetune.engine.cores import ClientCores, bound_cores, client_cores, client_record, held_by_engines, pinned_to
from tests.unit.test_engine_cores import topology


def test_the_bindings_cores_are_read_rank_by_rank():
    assert bound_cores("0") == [0] and bound_cores("0|2") == [0, 2] and bound_cores("4-5|0,1") == [0, 1, 4, 5]
    assert bound_cores("auto") == [] and bound_cores("nobind") == []


@pytest.mark.parametrize(
    ("bind", "allowed", "held", "expected"),
    [
        ("0", [0, 1], (), [1]),  # the 2-core host: the engine's rank on 0, the client on 1
        ("0|1", [0, 1, 2, 3], (), [2, 3]),  # two ranks: the client on the other two
        ("1", [0, 1, 2, 3], {2, 3}, [0]),  # another engine holds 2 and 3: off them
        ("0", [0, 1, 2, 3], {0, 1, 2, 3}, [1, 2, 3]),  # every core held by an engine: apart from this one's at least
        ("3", [2, 3], (), [2]),  # only the cores this process may use
    ],
)
def test_the_client_runs_on_the_cores_the_engine_is_not_bound_to(tmp_path, bind, allowed, held, expected):
    assert client_cores(bind, allowed, held, sysfs=tmp_path / "none") == ClientCores(expected)


def test_the_client_leaves_the_engines_physical_core_to_it_where_another_is_left(tmp_path):
    paired = topology(tmp_path / "sys", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})  # SMT siblings a half apart
    assert client_cores("0", [0, 1, 2, 3], sysfs=paired).cores == [1, 3]  # not 2: core 0's sibling
    assert client_cores("0", [0, 2], sysfs=paired).cores == [2]  # only the sibling is left: better than the same CPU


@pytest.mark.parametrize(
    ("bind", "allowed", "why"),
    [
        (None, [0, 1], "not bound to known cores (no CPU binding)"),  # a GPU engine
        ("auto", [0, 1], "not bound to known cores (auto)"),  # vLLM's own binding: which core is not known here
        ("0", [0], "bound to every core this process may use (1)"),  # one core
        ("0|1", [0, 1], "bound to every core this process may use (2)"),
    ],
)
def test_no_pin_where_there_is_no_core_apart_from_the_engines_and_the_record_says_why(bind, allowed, why):
    pin = client_cores(bind, allowed)
    assert pin.cores == [] and pin.unpinned is not None and why in pin.unpinned
    assert client_record(pin) == {"client_unpinned": pin.unpinned}
    assert client_record(ClientCores([2, 3])) == {"client_cores": "2,3"}


def test_the_cores_engines_hold_are_read_from_their_locks_and_the_probe_lets_go(tmp_path):
    with open(tmp_path / "core-1.lock", "a") as engine:
        fcntl.flock(engine, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert held_by_engines([0, 1, 2], tmp_path) == {1}
    assert held_by_engines([0, 1, 2], tmp_path) == set()  # nothing the probe took is still held


def test_the_client_here_reads_this_process_s_cores_and_the_hosts_locks(tmp_path, monkeypatch):
    monkeypatch.setenv(cores.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(cores, "SYSFS_CPU", tmp_path / "none")
    with open(tmp_path / "core-2.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cores.client_cores_here("0") == ClientCores([1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to a core apart needs two cores")
def test_the_process_runs_on_the_given_cores_inside_and_as_before_after():
    before = os.sched_getaffinity(0)
    one = min(before)
    waiting = threading.Event()
    earlier = threading.Thread(target=waiting.wait)  # a thread the process had before (a tokenizer's, a sampler's)
    earlier.start()
    try:
        with pinned_to([one]):
            assert os.sched_getaffinity(0) == {one} and os.sched_getaffinity(earlier.native_id) == {one}
        assert os.sched_getaffinity(0) == before and os.sched_getaffinity(earlier.native_id) == before
    finally:
        waiting.set()
        earlier.join()
    with pinned_to([]):  # nothing to pin to: left alone
        assert os.sched_getaffinity(0) == before
