"""The devices a study's trials through Serve hold, so that several run at once without sharing any.

A trial through Serve reserves only its load client's CPU in Tune (``study/nodes.py`` ``bundle``): its
replicas take their devices in placement groups Serve creates, which Tune does not count. With several
trials in flight, one would deploy into devices another's replicas hold, and wait inside its start-up
(its start-up time, and perhaps its timeout, would be the other trial's measuring). So before it deploys
a trial takes its devices (``serve.num_replicas`` x one replica's) from the study's ledger, an actor the
driver starts with the cluster's devices, and waits there, first come first served, while the devices
are held; it gives them back once its replicas are gone. The driver gives back a trial's devices too
when the trial ends: a killed trial process gives back nothing, and leaves its Serve application
deployed, which the driver deletes first. The ledger ends with the driver.

The ledger counts devices, not where they are: on one node (an 8-GPU host) any free device fits any
replica. On several nodes a replica of TP > 1 needs its devices on one node, and Serve may still wait
for a node with enough of them free.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ray.tune import Callback

#: Where the ledgers live among Ray's named actors; each run of a study names its own (:func:`ledger_name`).
NAMESPACE = "servetune"


def ledger_name(study: str) -> str:
    """A name for one run's ledger: the study's, and a part of its own, so another run (or a ledger Ray is
    still taking down) is never found in its place."""
    return f"servetune-serve-devices-{study}-{uuid.uuid4().hex[:12]}"


class DeviceLedger:
    """Devices held, by holder (a trial id); :meth:`take` waits in arrival order until enough are free.

    ``count``, when given, counts the cluster's devices again while trials wait (at most every ``every_s``):
    an autoscaler adds nodes, a node is lost."""

    def __init__(self, capacity: int, count: Callable[[], int] | None = None, every_s: float = 5.0) -> None:
        self.capacity = max(int(capacity), 1)
        self.count, self.every_s = count, every_s
        self.counted_at, self.counts = time.monotonic(), 0  # counts: the counts that succeeded
        self.held: dict[str, int] = {}
        self.queue: list[str] = []  # holders waiting, in arrival order
        # Holders given back (each takes once): one still waiting, or whose call is still on its way (its process
        # died), takes nothing.
        self.ended: set[str] = set()
        self.changed = asyncio.Condition()

    def free(self) -> int:
        return self.capacity - sum(self.held.values())

    def _recount(self) -> bool:
        """Count the cluster's devices again; whether the capacity changed."""
        self.counted_at = time.monotonic()
        try:
            counted = max(int(self.count()), 1) if self.count is not None else self.capacity
        except Exception:  # noqa: BLE001 - the cluster did not answer this time: the last count stands
            return False
        changed, self.capacity, self.counts = counted != self.capacity, counted, self.counts + 1
        return changed

    async def take(self, holder: str, devices: int) -> int:
        """Wait until ``devices`` are free and every earlier arrival has been served (a trial larger than the
        cluster waits until nothing is held: it runs alone, and Serve says whether it can be placed); hold them
        for ``holder``. Returns the devices held: 0 when the holder was given back while it waited (Ray does
        not stop an actor's call when its caller dies)."""
        asked = max(int(devices), 0)

        def admitted() -> bool:
            if holder in self.ended:  # given back while it waited: its process died
                return True
            return self.queue[0] == holder and (self.free() >= asked or not any(self.held.values()))

        async with self.changed:
            if holder in self.held:  # the same trial again (a retried call): it holds them already
                return self.held[holder]
            if holder in self.ended:  # given back before its call came in (its process died): it takes nothing
                return 0
            self.queue.append(holder)
            try:
                while not admitted():
                    timeout = None
                    if self.count is not None:
                        due = self.counted_at + self.every_s - time.monotonic()
                        if due <= 0:
                            if self._recount():
                                self.changed.notify_all()  # the other waiters judge the new count too
                            continue
                        timeout = due
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), timeout=timeout)
            finally:
                self.queue.remove(holder)
                self.changed.notify_all()
            if holder in self.ended:
                return 0
            self.held[holder] = asked
            return asked

    async def give_back(self, holder: str) -> int:
        """Free what ``holder`` holds (nothing when it holds nothing), and stop its wait if it waits, or a
        call of its not yet here (a holder is a trial or a verification of one run: it takes once); the devices
        freed."""
        async with self.changed:
            freed = self.held.pop(holder, 0)
            self.ended.add(holder)
            self.changed.notify_all()
            return freed

    async def state(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "held": dict(self.held), "waiting": list(self.queue), "counts": self.counts}


def devices_now(device: str, per_node: int) -> int:
    """The devices the live nodes of the connected Ray cluster have now (``study.packing.devices_of``)."""
    import ray

    from servetune.study.packing import devices_of

    return devices_of(device, per_node, [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")])


def start_ledger(name: str, device: str, per_node: int, every_s: float = 5.0) -> Any:
    """The ledger ``name`` as a Ray actor on this (the driver's) job, counting the cluster's ``device``
    (``devices_per_node`` ``per_node`` for the CPU stand-in) now and while trials wait; it ends with the driver."""
    import ray

    remote = ray.remote(num_cpus=0, max_concurrency=1000)(DeviceLedger)
    count = functools.partial(devices_now, device, per_node)
    return remote.options(name=name, namespace=NAMESPACE).remote(devices_now(device, per_node), count, every_s)


@contextlib.contextmanager
def devices_held(ledger_name: str | None, holder: str, devices: int) -> Iterator[None]:
    """``with devices_held(...)``: the trial's devices taken from the run's ledger (waiting for them), and
    given back on leaving; nothing to take where the run has no ledger (one trial at a time)."""
    import ray

    if ledger_name is None:
        yield
        return
    ledger = ray.get_actor(ledger_name, namespace=NAMESPACE)
    try:
        ray.get(ledger.take.remote(holder, devices))
        yield
    finally:
        give_back(ledger, holder)


def give_back(ledger: Any, holder: str) -> None:
    """Free what ``holder`` holds in ``ledger`` (a trial's own exit, the driver's callback, a dead verification)."""
    import ray

    with contextlib.suppress(Exception):  # the ledger died with the driver: nothing is held anywhere
        ray.get(ledger.give_back.remote(holder), timeout=30)


def delete_left_app(name: str) -> None:
    """Delete the Serve application ``name`` that a killed trial or verification task left deployed (its own
    teardown did not run), so its replicas free the devices the ledger hands on."""
    from servetune.serve.cluster import ServeCluster

    with contextlib.suppress(Exception):  # Serve is gone: nothing holds the devices
        ServeCluster.attached().delete(name)


class GiveBack(Callback):
    """The driver's side: a trial that ended holds nothing. One whose process was killed never deleted its
    Serve application, whose replicas would keep the devices the ledger hands on: it is deleted first."""

    def __init__(self, ledger: Any, holder_of: Callable[[dict[str, Any]], str], app_of: Callable[[dict[str, Any]], str]) -> None:
        self.ledger, self.holder_of, self.app_of = ledger, holder_of, app_of

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        give_back(self.ledger, self.holder_of(trial.config.get("params", {})))

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        params = trial.config.get("params", {})
        delete_left_app(self.app_of(params))
        give_back(self.ledger, self.holder_of(params))
