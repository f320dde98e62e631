"""The devices trials hold that Tune does not count, so that several run at once without sharing any.

Any room may import this module (it imports nothing of servetune's, and Ray only inside the functions
that call it): the study's driver starts the ledger, a trial takes its devices from it, a trial's engine
through Serve tells it where Ray placed them, and ``servetune run --verify-top`` takes devices for a
verification the same way.

A trial through Serve reserves only its load client's CPU in Tune (``trial/context.py`` ``bundle``): its
replicas take their devices in placement groups Serve creates, which Tune does not count. With several
trials in flight, one would deploy into devices another's replicas hold, and wait inside its start-up
(its start-up time, and perhaps its timeout, would be the other trial's measuring). So before it deploys
a trial takes its devices (``serve.num_replicas`` x one replica's) from the study's ledger, an actor the
driver starts with the cluster's devices, and waits there, first come first served, while the devices
are held; it gives them back once its replicas are gone. The driver gives back a trial's devices too
when the trial ends (``study/tuner.py`` ``GiveBack``): a killed trial process gives back nothing, and
leaves its Serve application deployed, which the driver deletes first. The ledger ends with the driver.

The ledger counts devices node by node. A replica runs inside one node (its placement group), so a trial
is admitted only when each of its replicas fits on some node's free devices: on two 8-GPU nodes with 6 and
4 held, a TP4 replica waits although 6 are free in all. Admitted, it would wait for a node inside its
start-up, or be stretched over both nodes by Ray Serve LLM's PACK strategy and measure tensor parallelism
across the network. The ledger's placement is a plan (the fullest node that fits each replica, as Ray packs
bundles); Serve places the replicas itself, and Ray weighs CPUs and memory too, so its choice can differ. So
while a trial deploys, where Ray put its replicas' devices (each replica's placement-group bundles, node by
node: a replica PACK stretched over two nodes counts on both) is read back and replaces the plan
(:meth:`DeviceLedger.placed_at`): a later arrival is judged by where the devices really went, from the
moment Ray placed them, not after the engines started, and again after each level (a replica Serve replaced
meanwhile, perhaps on another node). Between the admission and that read a newcomer is still judged by the
plan. A replica on a node that is lost is planned again on the nodes left, where Serve starts it again,
before a newcomer is let in.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

#: Where the ledgers live among Ray's named actors; each run of a study names its own (:func:`ledger_name`).
NAMESPACE = "servetune"


def ledger_name(study: str) -> str:
    """A name for one run's ledger: the study's, and a part of its own, so another run (or a ledger Ray is
    still taking down) is never found in its place."""
    return f"servetune-serve-devices-{study}-{uuid.uuid4().hex[:12]}"


#: The node of a ledger started with a device count alone (one node; the unit tests).
ONE_NODE = "node"
#: Where a trial the cluster could not hold even empty holds its devices: it runs alone, without a plan.
UNPLANNED = ""
Counts = Mapping[str, int]


def replica_sizes(devices: int, each: int | None) -> list[int]:
    """``devices`` as replicas of ``each`` (default: one of all); a remainder is one smaller replica."""
    devices = max(int(devices), 0)
    size = min(max(int(each or devices), 1), max(devices, 1))
    return [size] * (devices // size) + ([devices % size] if devices % size else [])


def placed(free: Mapping[str, int], sizes: list[int]) -> dict[str, int] | None:
    """Where replicas of ``sizes`` devices go on nodes with ``free`` devices, each inside one node, largest first:
    the fullest node that still fits (as Ray packs bundles, leaving whole nodes for larger replicas); the devices
    taken per node, or None where they do not all fit."""
    left, taken = dict(free), dict.fromkeys(free, 0)
    for each in sorted(sizes, reverse=True):
        fits = [node for node in sorted(left) if left[node] >= each]
        if not fits:
            return None
        node = min(fits, key=lambda n: left[n])
        left[node] -= each
        taken[node] += each
    return {node: n for node, n in taken.items() if n}


class DeviceLedger:
    """Devices held node by node, by holder (a trial id); :meth:`take` waits in arrival order until each of the
    holder's replicas fits on one node's free devices.

    ``capacity``: the devices of each node (a number: one node). ``count``, when given, counts the cluster's nodes
    again while trials wait (at most every ``every_s``): an autoscaler adds nodes, a node is lost."""

    def __init__(
        self, capacity: int | Counts, count: Callable[[], int | Counts] | None = None, every_s: float = 5.0
    ) -> None:
        self.nodes = _nodes(capacity)
        self.count, self.every_s = count, every_s
        self.counted_at, self.counts = time.monotonic(), 0  # counts: the counts that succeeded
        self.held: dict[str, dict[str, int]] = {}  # holder -> devices per node
        self.each: dict[str, int] = {}  # holder -> one replica's devices
        self.queue: list[str] = []  # holders waiting, in arrival order
        # Holders given back (each takes once): one still waiting, or whose call is still on its way (its process
        # died), takes nothing.
        self.ended: set[str] = set()
        self.changed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        return sum(self.nodes.values())

    def free_by_node(self) -> dict[str, int]:
        """Each node's devices less the holders' there; none anywhere while a trial too large to plan runs alone."""
        if any(where.get(UNPLANNED) for where in self.held.values()):
            return dict.fromkeys(self.nodes, 0)
        used = dict.fromkeys(self.nodes, 0)
        for where in self.held.values():
            for node, n in where.items():
                if node in used:  # a lost node's devices are gone, held or not
                    used[node] += n
        return {node: max(self.nodes[node] - used[node], 0) for node in self.nodes}

    def free(self) -> int:
        return sum(self.free_by_node().values())

    def _recount(self) -> bool:
        """Count the cluster's nodes again; whether their devices changed."""
        self.counted_at = time.monotonic()
        try:
            counted = _nodes(self.count()) if self.count is not None else self.nodes
        except Exception:  # the cluster did not answer this time: the last count stands
            return False
        changed, self.nodes, self.counts = counted != self.nodes, counted, self.counts + 1
        if changed:
            self._replan_lost()
        return changed

    def _replan_lost(self) -> None:
        """A holder's replicas on a node that is gone: Serve starts them again on the nodes left, so the plan moves
        them there too, where they fit (what fits nowhere stays on the lost node, counted nowhere)."""
        for holder, where in self.held.items():
            lost = {node: n for node, n in where.items() if node not in self.nodes and node != UNPLANNED and n}
            if not lost:
                continue
            sizes = [size for n in lost.values() for size in replica_sizes(n, self.each.get(holder))]
            moved = placed(self.free_by_node(), sizes)
            if moved is not None:
                for node in lost:
                    del where[node]
                for node, n in moved.items():
                    where[node] = where.get(node, 0) + n

    async def take(self, holder: str, devices: int, each: int | None = None) -> int:
        """Wait until every earlier arrival has been served and ``devices`` fit, in replicas of ``each`` devices
        (default: one replica of all), each inside one node; hold them for ``holder``. A trial the cluster could not
        hold even empty waits until nothing is held: it runs alone, and Serve says whether it can be placed.
        Returns the devices held: 0 when the holder was given back while it waited (Ray does not stop an actor's
        call when its caller dies)."""
        asked = max(int(devices), 0)
        sizes = replica_sizes(asked, each)
        where: dict[str, int] | None = None

        def admitted() -> bool:
            nonlocal where
            if holder in self.ended:  # given back while it waited: its process died
                return True
            if self.queue[0] != holder:
                return False
            where = placed(self.free_by_node(), sizes)
            if where is None and not any(any(w.values()) for w in self.held.values()):
                where = {UNPLANNED: asked}  # it runs alone
            return where is not None

        async with self.changed:
            if holder in self.held:  # the same trial again (a retried call): it holds them already
                return sum(self.held[holder].values())
            if holder in self.ended:  # given back before its call came in (its process died): it takes nothing
                return 0
            self.queue.append(holder)
            if self.count is not None and time.monotonic() >= self.counted_at + self.every_s:
                self._recount()  # not judged by a count gone stale while nobody waited (a node lost since)
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
            self.held[holder] = where or {}
            self.each[holder] = sizes[0] if sizes else 1
            return asked

    async def placed_at(self, holder: str, devices: Mapping[str, int]) -> dict[str, int] | None:
        """Where Ray placed ``holder``'s replicas (devices per node, read from Ray: each replica's placement-group
        bundles) in place of the plan, once every device it holds is placed; the devices per node it now holds, or
        None (it holds nothing, not every replica is placed yet, or the read cannot be right: the plan stands)."""
        async with self.changed:
            where = self.held.get(holder)
            if where is None:
                return None
            actual = {str(node): int(n) for node, n in devices.items() if int(n) > 0}
            if sum(actual.values()) != sum(where.values()) or UNPLANNED in where:
                return None  # not every replica placed yet; or a trial that runs alone, stretched over nodes
            if any(n > self.nodes.get(node, 0) for node, n in actual.items()):
                return None  # more on a node than it has (a node the count does not know yet): the plan stands
            if actual != where:
                self.held[holder] = actual
                self.changed.notify_all()  # a node the plan held may be free after all: waiters judge again
            return dict(actual)

    async def give_back(self, holder: str) -> int:
        """Free what ``holder`` holds (nothing when it holds nothing), and stop its wait if it waits, or a
        call of its not yet here (a holder is a trial or a verification of one run: it takes once); the devices
        freed."""
        async with self.changed:
            freed = sum(self.held.pop(holder, {}).values())
            self.each.pop(holder, None)
            self.ended.add(holder)
            self.changed.notify_all()
            return freed

    async def state(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "nodes": dict(self.nodes), "held": {h: sum(w.values()) for h, w in self.held.items()},
                "placed": {h: dict(w) for h, w in self.held.items()}, "waiting": list(self.queue), "counts": self.counts}  # fmt: skip


def _nodes(capacity: int | Counts) -> dict[str, int]:
    if isinstance(capacity, Mapping):
        return {str(node): max(int(n), 0) for node, n in capacity.items()}
    return {ONE_NODE: max(int(capacity), 1)}


def devices_by_node(device: str, per_node: int, nodes: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
    """The devices each node lends trials through Serve (the ledger's capacity), by node id: its GPUs; on the CPU
    stand-in, ``devices_per_node`` (``per_node``) of its cores (a replica claims a core per rank, serve/cores.py)."""
    if device == "gpu":
        return {node: int(resources.get("GPU", 0.0)) for node, resources in nodes.items()}
    return {node: int(min(per_node, resources.get("CPU", 0.0))) for node, resources in nodes.items()}


def devices_now(device: str, per_node: int) -> dict[str, int]:
    """The devices each live node of the connected Ray cluster has now (:func:`devices_by_node`)."""
    import ray

    return devices_by_node(
        device, per_node, {node["NodeID"]: dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")}
    )


def start_ledger(name: str, device: str, per_node: int, every_s: float = 5.0) -> Any:
    """The ledger ``name`` as a Ray actor on this (the driver's) job, counting the cluster's ``device``
    (``devices_per_node`` ``per_node`` for the CPU stand-in) now and while trials wait; it ends with the driver."""
    import ray

    # ray.remote's keyword overload lists task options only; a class takes actor options too (as Ray documents)
    remote = ray.remote(num_cpus=0, max_concurrency=1000)(DeviceLedger)  # type: ignore[call-overload]
    count = functools.partial(devices_now, device, per_node)
    return remote.options(name=name, namespace=NAMESPACE).remote(devices_now(device, per_node), count, every_s)


#: The ledger and holder of the devices this process holds (:func:`devices_held`), for :func:`report_placement`.
_HOLDING: contextvars.ContextVar[tuple[Any, str] | None] = contextvars.ContextVar(
    "servetune_serve_holding", default=None
)


@contextlib.contextmanager
def devices_held(ledger_name: str | None, holder: str, devices: int, each: int | None = None) -> Iterator[None]:
    """``with devices_held(...)``: the trial's devices (replicas of ``each``) taken from the run's ledger (waiting
    for them), and given back on leaving; nothing to take where the run has no ledger (one trial at a time).
    Inside, :func:`report_placement` tells the ledger where Ray placed the replicas."""
    import ray

    if ledger_name is None:
        yield
        return
    ledger = ray.get_actor(ledger_name, namespace=NAMESPACE)
    token = _HOLDING.set((ledger, holder))
    try:
        ray.get(ledger.take.remote(holder, devices, each))
        yield
    finally:
        give_back(ledger, holder)
        _HOLDING.reset(token)


def report_placement(devices: Mapping[str, int]) -> dict[str, int] | None:
    """Tell the ledger of the devices this process holds (:func:`devices_held`) where Ray placed them (devices per
    node); the devices per node it now holds there, None where nothing is held or it was not taken."""
    import ray

    holding = _HOLDING.get()
    if holding is None or not devices:
        return None
    ledger, holder = holding
    try:
        return ray.get(ledger.placed_at.remote(holder, dict(devices)), timeout=30)
    except Exception:  # the ledger died with the driver: the plan is all there is
        return None


def replica_share(spec: Any) -> tuple[int, int]:
    """(devices, one replica's devices) of a trial through Serve, as :func:`devices_held` takes them."""
    return spec.devices, max(spec.devices // max(spec.serve_replicas or 1, 1), 1)


def give_back(ledger: Any, holder: str) -> None:
    """Free what ``holder`` holds in ``ledger`` (a trial's own exit, the driver's callback, a dead verification)."""
    import ray

    with contextlib.suppress(Exception):  # the ledger died with the driver: nothing is held anywhere
        ray.get(ledger.give_back.remote(holder), timeout=30)
