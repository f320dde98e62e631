"""The replica that records its engine's signals for the predictive policy: read from Ray's metrics agent
(here a local stand-in serving the agent's text), recorded through Serve's ``record_autoscaling_stats``."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from servetune.metrics import KV_METRIC, WAITING_METRIC
from servetune.report.autoscale_policy import PredictivePolicy
from servetune.serve.metrics import EngineSignals, autoscaling_signals

# Ray's LLMServer has an ``async def __del__``: a replica built without its engine warns when collected.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'LLMServer.__del__' was never awaited:RuntimeWarning")

#: A node's agent as Ray 2.60 exports vLLM's gauges: replica r1 with two engines (DP), r2, and r1's
#: running requests (not a signal the policy reads).
AGENT = """\
# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 6.0
# HELP ray_vllm_num_requests_waiting Number of requests waiting to be processed.
# TYPE ray_vllm_num_requests_waiting gauge
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 3.0
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="1",model_name="tiny"} 4.0
ray_vllm_num_requests_waiting{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 40.0
# TYPE ray_vllm_kv_cache_usage_perc gauge
ray_vllm_kv_cache_usage_perc{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="0",model_name="tiny"} 0.3
ray_vllm_kv_cache_usage_perc{Component="core_worker",ReplicaId="r1",WorkerId="w1",engine="1",model_name="tiny"} 0.7
ray_vllm_kv_cache_usage_perc{Component="core_worker",ReplicaId="r2",WorkerId="w2",engine="0",model_name="tiny"} 0.99
# TYPE ray_serve_num_ongoing_requests_at_replicas gauge
ray_serve_num_ongoing_requests_at_replicas{ReplicaId="r1",deployment="LLMServer:tiny"} 9.0
"""


def test_a_replicas_signals_are_its_own_engines_under_the_policys_names():
    assert autoscaling_signals(AGENT, "r1") == {WAITING_METRIC: 7.0, KV_METRIC: pytest.approx(0.7)}  # DP: sum, fullest
    assert autoscaling_signals(AGENT, "r2") == {WAITING_METRIC: 40.0, KV_METRIC: pytest.approx(0.99)}
    assert autoscaling_signals(AGENT, "r3") == {}  # not exported yet
    waiting_only = "\n".join(line for line in AGENT.splitlines() if "kv_cache" not in line) + "\n"
    assert autoscaling_signals(waiting_only, "r1") == {WAITING_METRIC: 7.0}
    # vLLM's older name for KV usage, as Ray renames it
    older = AGENT.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert autoscaling_signals(older, "r1")[KV_METRIC] == pytest.approx(0.7)


class _Agent:
    """A stand-in for Ray's metrics agent: serves ``text`` on /metrics, counts the scrapes."""

    def __init__(self) -> None:
        self.text = AGENT
        self.scrapes = 0
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                agent.scrapes += 1
                body = agent.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"


@pytest.fixture
def agent() -> Iterator[_Agent]:
    found = _Agent()
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()
    thread.join()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_signals_are_read_from_the_agent_each_time(agent):
    signals = EngineSignals(agent.url, "r1")
    assert signals.read() == {WAITING_METRIC: 7.0, KV_METRIC: pytest.approx(0.7)}
    agent.text = AGENT.replace("} 3.0", "} 13.0")
    assert signals.read()[WAITING_METRIC] == 17.0
    assert agent.scrapes == 2
    with pytest.raises(OSError):
        EngineSignals(f"http://127.0.0.1:{_closed_port()}/metrics", "r1", timeout_s=2).read()


def _replica(signals: EngineSignals):
    """servetune's replica class without its engine: only what ``record_autoscaling_stats`` uses."""
    from servetune.serve.replica import LLMServer

    replica = LLMServer.__new__(LLMServer)
    replica._signals = signals
    return replica


def test_the_replica_records_its_signals_for_serve_and_the_policy_reads_them(agent):
    replica = _replica(EngineSignals(agent.url, "r1"))
    recorded = asyncio.run(replica.record_autoscaling_stats())
    assert recorded == {WAITING_METRIC: 7.0, KV_METRIC: pytest.approx(0.7)}
    assert all(isinstance(v, float) for v in recorded.values())  # Serve disables stats of any other type

    context = SimpleNamespace(  # Serve's AutoscalingContext: per replica, the recorded stats averaged
        aggregated_metrics={name: {"r1": value} for name, value in recorded.items()},
        total_queued_requests=0.0, total_num_requests=4.0, current_num_replicas=1,
    )  # fmt: skip
    policy = PredictivePolicy(target_ongoing_requests=4.0, waiting_per_replica=5.0, kv_usage_limit=0.85)
    wanted, info = policy(context)
    assert (wanted, info["servetune_signal"]) == (2, "queue wait")  # 7 waiting / 5 per replica; in flight asks 1


def test_a_replica_whose_agent_does_not_answer_records_nothing_and_says_so_once(caplog):
    replica = _replica(EngineSignals(f"http://127.0.0.1:{_closed_port()}/metrics", "r1", timeout_s=2))
    with caplog.at_level(logging.WARNING, logger="servetune.serve.replica"):
        assert asyncio.run(replica.record_autoscaling_stats()) == {}
        assert asyncio.run(replica.record_autoscaling_stats()) == {}
    warned = [r.getMessage() for r in caplog.records if "engine signals not recorded" in r.getMessage()]
    assert len(warned) == 1 and "Serve's counts only" in warned[0]


def test_a_replica_imports_without_report():
    """Every replica of a deployment exported with ``--autoscaling-policy predictive`` imports serve/replica.py:
    it needs two metric names of the policy's, not report/ (22 modules, with them config/ and capacity/: 0.17-0.24 s
    of a core per replica, bench/replica_imports.py --predictive). Ray Serve LLM's ``LLMServer`` is a stand-in here, so that only servetune's
    own imports run (Ray's and vLLM's take 10 s of a core and are not servetune's to cut)."""
    code = ("import sys, types; ray_llm = types.ModuleType('ray.serve.llm.deployment'); ray_llm.LLMServer = object; "
            "sys.modules[ray_llm.__name__] = ray_llm; import servetune.serve.replica; "
            "print(sorted(m for m in sys.modules if m.startswith('servetune.report')))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
