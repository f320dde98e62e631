"""vLLM's server metrics of a Serve deployment's replicas, as one server's ``/metrics`` would give them.

Ray Serve LLM's engines have no ``/metrics`` of their own that a client reaches: they export vLLM's
metrics through Ray's metrics agent (``log_engine_metrics``, on by default), renamed (``vllm:x`` ->
``ray_vllm_x``) and labelled with the Serve replica they come from (``ReplicaId``, the replica's
unique id). :func:`replicas_snapshot` keeps the given replicas' samples from the agents' texts (one
per node), reads each replica as vLLM's own text would read (``engine.metrics``), and adds them up:
the deployment as one server, queue and KV usage included. Pure; ``serve/cluster.py`` reads the agents.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from prometheus_client.parser import text_string_to_metric_families

from servetune.engine.metrics import GAUGES, MetricsSnapshot, lines_of

#: How Ray's metrics agent names vLLM's metrics: ``vllm:num_requests_waiting`` -> ``ray_vllm_num_requests_waiting``.
RAY_PREFIX, VLLM_PREFIX = "ray_vllm_", "vllm:"
_RAY_GAUGES = tuple(RAY_PREFIX + name.removeprefix(VLLM_PREFIX) for names in GAUGES.values() for name in names)


def replica_snapshots(
    texts: Iterable[str], replica_ids: Collection[str], gauges_only: bool = False
) -> dict[str, MetricsSnapshot]:
    """Each of the given replicas' vLLM metrics in the agents' ``texts``, read as vLLM's own text would
    be; a replica with no sample there (yet: an agent exports what a worker reported a report interval
    ago) is absent."""
    per_replica: dict[str, dict[str, list]] = {}
    for text in texts:
        try:
            families = list(text_string_to_metric_families(lines_of(text, _RAY_GAUGES) if gauges_only else text))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                replica = sample.labels.get("ReplicaId")
                if replica is None or replica not in replica_ids or not sample.name.startswith(RAY_PREFIX):
                    continue
                name = VLLM_PREFIX + sample.name.removeprefix(RAY_PREFIX)
                per_replica.setdefault(replica, {}).setdefault(name, []).append(sample)
    return {replica: MetricsSnapshot.from_samples(samples) for replica, samples in per_replica.items()}


def replicas_snapshot(
    texts: Iterable[str], replica_ids: Collection[str], gauges_only: bool = False
) -> MetricsSnapshot | None:
    """The replicas' vLLM metrics in the agents' ``texts``, added up as one server's
    (:meth:`MetricsSnapshot.combined`); None when no sample of theirs is there."""
    found = replica_snapshots(texts, replica_ids, gauges_only)
    return MetricsSnapshot.combined(list(found.values())) if found else None


class ReplicaCounts:
    """A deployment's counters kept monotonic while replicas come and go: each replica's last full read
    stays counted once it is gone (Serve replaced it, or its node's agent did not answer this time), and
    a new replica counts from its own start. Gauges are the replicas read now."""

    def __init__(self) -> None:
        self.last: dict[str, MetricsSnapshot] = {}

    def update(self, now: dict[str, MetricsSnapshot]) -> MetricsSnapshot | None:
        self.last.update(now)
        if not self.last:
            return None
        total = MetricsSnapshot.combined(list(self.last.values()))
        total.gauges = MetricsSnapshot.combined(list(now.values())).gauges
        return total
