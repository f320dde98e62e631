"""The LLM replica that ``export --autoscaling-policy predictive`` deploys: Ray Serve LLM's ``LLMServer`` that also
records its engine's requests waiting and KV-cache usage for the predictive policy (report/autoscale_policy.py).

Serve calls a replica's ``record_autoscaling_stats`` (when the deployment autoscales) every record interval
(``look_back_period_s`` x 0.2) and hands the controller's policy the numbers averaged per replica over
``look_back_period_s`` (``AutoscalingContext.aggregated_metrics``). Ray Serve LLM's engine runs inside the replica
and exports vLLM's metrics through Ray's metrics agent, labelled with the replica's id; :class:`LLMServer`
reads its own there (``serve.metrics.EngineSignals``), off the replica's event loop. A deployment uses it through
``LLMConfig.server_cls`` = ``report.export.SIGNALS_SERVER_CLASS`` (``build_openai_app`` honours it; Ray 2.60's DP
builder does not); servetune must be installed where the replicas run.

Where the agent does not answer, or has no sample of the replica yet (it exports a report interval late), the
replica records nothing (logged once): the policy then scales on Serve's own counts, as with any other replica.
"""

from __future__ import annotations

import asyncio
import logging

from ray.serve.llm.deployment import LLMServer as RayLLMServer

from servetune.serve.metrics import EngineSignals

logger = logging.getLogger(__name__)


class LLMServer(RayLLMServer):
    """Ray Serve LLM's ``LLMServer``, recording its engine's ``num_requests_waiting`` and ``kv_cache_usage``.

    Named as Ray's: Ray Serve LLM names the deployment after the class (``LLMServer:<model id>``), and
    serve-check, verify and dashboards find the LLM deployment by that name."""

    _signals: EngineSignals | None = None  # found on the first call: Ray's node and the replica's id
    _unread_logged: bool = False

    async def record_autoscaling_stats(self) -> dict[str, float]:
        try:
            if self._signals is None:
                self._signals = await asyncio.to_thread(EngineSignals.of_this_replica)
            found = await asyncio.to_thread(self._signals.read)
        except (OSError, LookupError) as exc:
            self._log_unread(f"{exc}")
            return {}
        if not found:
            self._log_unread(f"no sample of replica {self._signals.replica_id} at {self._signals.url} yet")
        return found

    def _log_unread(self, why: str) -> None:
        if not self._unread_logged:
            self._unread_logged = True
            logger.warning("servetune: engine signals not recorded for autoscaling (%s); Serve's counts only", why)
