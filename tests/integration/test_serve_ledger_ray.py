"""The study's device ledger on a real local Ray (device_ledger.py): a trial process waits for devices another
trial holds, takes them when it gives them back, and the driver frees what a killed trial held."""

import threading
import time
from types import SimpleNamespace

import pytest

from servetune.device_ledger import devices_held, ledger_name, start_ledger
from servetune.study.tuner import GiveBack

ray = pytest.importorskip("ray")


def until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_trial_waits_for_devices_another_holds_and_the_driver_frees_a_killed_trials(local_ray):
    with devices_held(None, "alone", 8):  # no ledger (one trial at a time): nothing to wait for
        pass
    name = ledger_name("s")
    assert name != ledger_name("s")  # each run its own
    ledger = start_ledger(
        name, "cpu", 2, every_s=0.2
    )  # the CPU stand-in: devices_per_node cores of each node, from Ray
    events = []

    def second():
        with devices_held(name, "b", 1):
            events.append("b took")

    with devices_held(name, "a", 2):
        waiting = threading.Thread(target=second)
        waiting.start()
        until(lambda: ray.get(ledger.state.remote())["waiting"] == ["b"])
        until(
            lambda: ray.get(ledger.state.remote())["counts"] >= 2
        )  # counted again from inside the actor, while b waits
        assert events == [] and ray.get(ledger.state.remote())["capacity"] == 2
        events.append("a gives back")
    waiting.join(timeout=30)
    assert events == ["a gives back", "b took"]
    state = ray.get(ledger.state.remote())
    assert (state["capacity"], state["held"], state["waiting"]) == (2, {}, [])
    # A trial whose process was killed never gives back: the driver's callback does, by the trial's id, once it
    # deleted the trial's Serve application (none here: Serve is not running, and that is no error).
    ray.get(ledger.take.remote("killed", 2))
    deleted = []

    def app_of(params):
        deleted.append(params["x"])
        return f"servetune-s-{params['x']}"

    GiveBack(ledger, lambda params: f"trial-{params['x']}", app_of).on_trial_error(
        0, [], SimpleNamespace(config={"params": {"x": "killed"}})
    )
    assert ray.get(ledger.state.remote())["held"] == {"killed": 2} and deleted == [
        "killed"
    ]  # another id: nothing freed
    GiveBack(ledger, lambda params: params["x"], app_of).on_trial_complete(
        0, [], SimpleNamespace(config={"params": {"x": "killed"}})
    )
    assert ray.get(ledger.state.remote())["held"] == {} and deleted == ["killed"]  # a finished trial deleted its own
