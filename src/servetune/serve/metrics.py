"""vLLM's server metrics of a Serve deployment's replicas, as one server's ``/metrics`` would give them.

Ray Serve LLM's engines have no ``/metrics`` of their own that a client reaches: they export vLLM's
metrics through Ray's metrics agent (``log_engine_metrics``, on by default), renamed (``vllm:x`` ->
``ray_vllm_x``) and labelled with the Serve replica they come from (``ReplicaId``, the replica's
unique id). :func:`replicas_snapshot` keeps the given replicas' samples from the agents' texts (one
per node), reads each replica as vLLM's own text would read (``engine.metrics``), and adds them up:
the deployment as one server, queue and KV usage included. Pure; ``serve/cluster.py`` reads the agents.

:class:`EngineSignals` is the one reader here: a replica's own requests waiting and KV-cache usage, from its
node's agent, for the predictive autoscaling policy (``serve/replica.py`` records them for Serve).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from servetune.engine.metrics import LIGHT_FAMILIES, MetricsSnapshot, lines_of
from servetune.metrics import KV_METRIC, WAITING_METRIC

#: How Ray's metrics agent names vLLM's metrics: ``vllm:num_requests_waiting`` -> ``ray_vllm_num_requests_waiting``.
RAY_PREFIX, VLLM_PREFIX = "ray_vllm_", "vllm:"
#: What a light read parses (engine/metrics.py ``LIGHT_FAMILIES``: the gauges and the finished requests), as named here.
_RAY_LIGHT = tuple(RAY_PREFIX + name.removeprefix(VLLM_PREFIX) for name in LIGHT_FAMILIES)


def replica_snapshots(
    texts: Iterable[str], replica_ids: Collection[str], gauges_only: bool = False
) -> dict[str, MetricsSnapshot]:
    """Each of the given replicas' vLLM metrics in the agents' ``texts``, read as vLLM's own text would
    be; a replica with no sample there (yet: an agent exports what a worker reported a report interval
    ago) is absent."""
    per_replica: dict[str, dict[str, list]] = {}
    # Only vLLM's lines are parsed (its gauges' and finished requests' where asked): an agent's text is mostly Ray's and
    # Serve's own metrics.
    wanted = _RAY_LIGHT if gauges_only else (RAY_PREFIX,)
    for text in texts:
        try:
            families = list(text_string_to_metric_families(lines_of(text, wanted)))
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


#: The predictive policy's names (``record_autoscaling_stats``) of the gauges read (``engine.metrics.GAUGES``).
AUTOSCALING_GAUGES = {"requests_waiting": WAITING_METRIC, "kv_cache_usage": KV_METRIC}
#: How long a replica waits for its node's metrics agent: within the 10 s Serve gives ``record_autoscaling_stats``
#: (``RAY_SERVE_RECORD_AUTOSCALING_STATS_TIMEOUT_S``).
SIGNALS_TIMEOUT_S = 5.0


def autoscaling_signals(text: str, replica_id: str) -> dict[str, float]:
    """One replica's engine signals in an agent's ``text``, named as the predictive policy reads them
    (``num_requests_waiting``: all its engines' waiting requests; ``kv_cache_usage``: 0..1, the fullest engine's);
    a signal with no sample of that replica there is left out (the policy then goes without it)."""
    snap = replica_snapshots([text], {replica_id}, gauges_only=True).get(replica_id)
    if snap is None:
        return {}
    return {ours: snap.gauges[gauge] for gauge, ours in AUTOSCALING_GAUGES.items() if gauge in snap.gauges}


@dataclass(frozen=True)
class EngineSignals:
    """Where one Serve replica's engine signals are read: its node's metrics agent (``url``, Prometheus text)
    and the replica's id, the ``ReplicaId`` label vLLM gives the replica's metrics there. The agent exports
    what a worker reported one report interval ago (Ray's ``metrics_report_interval_ms``, 10 s by default)."""

    url: str
    replica_id: str
    timeout_s: float = SIGNALS_TIMEOUT_S

    def read(self) -> dict[str, float]:
        """The replica's signals now (:func:`autoscaling_signals`); OSError when the agent does not answer."""
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
            return autoscaling_signals(resp.read().decode(), self.replica_id)

    @classmethod
    def of_this_replica(cls) -> EngineSignals:
        """The signals of the Serve replica this runs in, read on its own node's agent; LookupError where
        Ray reports no metrics export port for the node."""
        import ray
        from ray import serve

        here = ray.get_runtime_context().get_node_id()
        port = next((n.get("MetricsExportPort") for n in ray.nodes() if n.get("NodeID") == here), None)
        if not port:
            raise LookupError(f"Ray reports no metrics export port for node {here}")
        return cls(f"http://127.0.0.1:{port}/metrics", serve.get_replica_context().replica_id.unique_id)


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
