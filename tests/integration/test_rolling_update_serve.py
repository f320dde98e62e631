"""verify's rolling_update scenario on a real local Ray with Serve, its replicas running the fake Serve engine
(testing/serve_engine.py) in place of vLLM: a deployment of two replicas moved under load, through Serve's own
update path, to the runner-up's configuration, whose engine arguments (``max_num_seqs``) and environment (the fake's
TTFT) differ. From Serve's state and the replicas themselves: before the update both replicas run the verified
point's configuration, after it both run the runner-up's (built on the cluster it runs on, as the verified point's
was), and none from before is alive, nor its process. The scenario reads what the replicas run from what each told Ray's
key-value store beside its core claim, never their ``LLMConfig`` (unpickling one imports vLLM): a fresh Ray worker
reads the same answer without importing vLLM, and imports it reading the ``LLMConfig``s (the fallback). Only the LLM deployment moved: the ingress replica is the same
one before and after, and the scenario's replica changes say so (two LLM replicas stopped, two started, the ingress
kept). From the request records: the scenario's counts and worst TTFT during the change, and the requests after it
paced by the new replicas. Every engine takes :data:`START_S` to start: a request that waited for a replica to start
(none serving, or the router gone) would have waited at least that long, and none did.

Before the update, two levels are measured on the deployment as a Serve trial's ladder measures them (``measure_rung``
given the ServeEngine): each keeps its busiest front-end process's share of a core (Serve's proxy, the ingress or an
LLM replica: serve/frontend.py).

Then, on the updated deployment under the same load, verify's replica_lost scenario (opt-in in verify): one replica's
process killed (the fake engine runs in the replica's own process), Serve's replacement, and what the clients saw.

Both run in a process of its own, which starts a Ray sized for the deployment and stops it (about 2 min on a
two-core host); it writes what the tests check to a JSON file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from servetune.config.slo import Slo
from servetune.config.workload import Workload
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import TrialSpec
from servetune.verify.scenarios import Budget
from tests.builders import space_from
from tests.ray_heads import skip_without_ray_serve_llm

skip_without_ray_serve_llm()  # imported by the driver only (this process reads what it wrote)

ROOT = Path(__file__).parents[2]
# Each fake engine's start: what a request that waited for a replica to start would have waited, at least; three
# times the worst TTFT seen on a busy host (2.6 s, CI of stop 51, integration in two processes).
START_S = 8.0
# The fake's time between tokens: a request (16 tokens) takes about 0.35 s, so 3 clients send about 9 requests a second
# through Serve's proxy, ingress and replicas (at 5 ms, about 30: CPU on a two-core host that the replicas' starts,
# and so the rollout the load runs through, wait for). Every client still has a request in flight at all times, so each
# 1 s window of replica_lost and the 4 s after each change have requests. Nothing here is asserted of the ITL.
ITL_MS = 20
SPACE = """\
hardware: {{devices_per_node: 2}}
engine_args: {{max_model_len: 1024}}
env:
  RAYLLM_VLLM_ENGINE_CLS: "{engine_cls}"
  SERVETUNE_FAKE_ITL_MS: {itl_ms}
  {start_s_env}: {start_s}
params:
  serve.num_replicas: [2]
  max_num_seqs: [4, 8]
  env.SERVETUNE_FAKE_TTFT_MS: [20, 60]
"""
WORKLOAD = Workload(
    name="chat", input_tokens={"dist": "fixed", "value": 16}, output_tokens={"dist": "fixed", "value": 16}
)
SLO = Slo.parse("ttft_ms.p99=5000")
# The update 2 s into the load, the load 4 s more once the rollout is done.
BUDGET = Budget(soak_s=4.0, windows=4, scenario_s=4.0, long_requests=2, long_output_cap=64, drop_rounds=1, repeats=5,
                repeat_s=1.0, warmup_cap=2)  # fmt: skip
RUNNER_UP_TTFT_S = 0.060


def specs(root: Path, model: str) -> tuple[TrialSpec, TrialSpec]:
    """The verified point (max_num_seqs 4, the fake's TTFT 20 ms) and the runner-up (8, 60 ms), two replicas each."""
    from servetune.testing.serve_engine import ENGINE_ENV, START_S_ENV  # Ray Serve LLM's: in the driver

    space = space_from(root, SPACE.format(engine_cls=ENGINE_ENV["RAYLLM_VLLM_ENGINE_CLS"], start_s_env=START_S_ENV,
                                          start_s=START_S, itl_ms=ITL_MS))  # fmt: skip
    workload = space.resolved_workload(root)
    context = StudyContext(space, workload, root, model, resolve_levels(space, workload))
    winner = context.spec_for({"serve.num_replicas": 2, "max_num_seqs": 4, "env.SERVETUNE_FAKE_TTFT_MS": 20})
    runner_up = context.spec_for({"serve.num_replicas": 2, "max_num_seqs": 8, "env.SERVETUNE_FAKE_TTFT_MS": 60})
    return winner, runner_up


def roll(work: str, model: str) -> None:
    """The scenario as verify runs it on a local Ray (run.py ``started``: the configuration moved to chosen before
    Ray starts), in this process; what the test checks goes to ``work/rolled.json``."""
    from servetune.load.client import StreamingClient
    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.serve.actors import wait_gone
    from servetune.serve.cluster import ServeCluster
    from servetune.serve.trial import ServeEngine, trial_needs
    from servetune.testing.serve_engine import STARTED
    from servetune.verify.replica_lost import replica_lost
    from servetune.verify.rolling_update import new_configuration, rolling_update
    from servetune.verify.scenarios import Target

    root = Path(work)
    winner, runner_up = specs(root, model)
    new_spec, change = new_configuration(winner, runner_up)
    prompts = PromptFactory(load_tokenizer(model))
    (root / "verify").mkdir()
    out: dict = {"change": change}
    with ServeCluster(None, trial_needs(winner).resources()) as cluster, ServeEngine(winner, root / "verify", cluster) as engine:  # fmt: skip
        # the LLM replicas' processes (the ingress's stays: it is the same replica after the update)
        before_pids = sorted(
            {pid for replica, engines in cluster.replica_engines(engine.name) for pid in [replica, *engines]}
        )
        out["before"] = {"replicas": cluster.engine_replicas(engine.name), "ingress": ingress(cluster, engine.name),
                         "configs": cluster.replica_llm_configs(engine.name)}  # fmt: skip

        out["ladder"] = ladder(engine, winner.model, prompts)

        async def scenario(run):
            async with StreamingClient(engine.url, winner.model, timeout_s=60, first_token_timeout_s=30,
                                       idle_timeout_s=30) as client:  # fmt: skip
                target = Target(client=client, url=engine.url, workload=WORKLOAD, prompts=prompts, slo=SLO,
                                level=Level("concurrency", 3.0), budget=BUDGET, max_model_len=1024, engine=engine)  # fmt: skip
                return await run(target), target.records

        # The scenario asks the replicas what they run from what they told (serve/claims.py), never their LLMConfig.
        read_configs = cluster.replica_llm_configs
        asked: list[str] = []
        cluster.replica_llm_configs = lambda name, *a, **k: asked.append(name) or read_configs(name, *a, **k)  # type: ignore[method-assign]
        result, records = asyncio.run(scenario(lambda t: rolling_update(t, new_spec, change, update_timeout_s=240)))
        cluster.replica_llm_configs = read_configs  # type: ignore[method-assign]
        out["configs_asked_by_scenario"] = len(asked)
        out["fresh_reader"] = fresh_reader(engine.name, engine.deployed)
        out.update(passed=result.passed, reason=result.reason, numbers=result.numbers,
                   records=[dataclasses.asdict(r) for r in records])  # fmt: skip
        out["after"] = {"replicas": cluster.engine_replicas(engine.name), "ingress": ingress(cluster, engine.name),
                        "configs": cluster.replica_llm_configs(engine.name)}  # fmt: skip
        out["old_processes_left"] = wait_gone(before_pids, timeout_s=60)
        out["before_processes"] = len(before_pids)
        # Then, on the updated deployment, verify's replica_lost: one replica's process killed under the same load,
        # Serve's replacement waited for (the trial's start-up time: a replica's start here is its engine's 8 s and
        # Ray Serve LLM's import).
        lost, lost_records = asyncio.run(scenario(lambda t: replica_lost(t, 2, replace_timeout_s=240)))
        out["lost"] = {"passed": lost.passed, "reason": lost.reason, "numbers": lost.numbers,
                       "records": [dataclasses.asdict(r) for r in lost_records],
                       "replicas": cluster.engine_replicas(engine.name)}  # fmt: skip
        # what each engine started with, in its own words in the replicas' log (the old replicas' lines kept)
        out["started"] = [json.loads(line.split(STARTED, 1)[1]) for line in engine.log_text().splitlines()
                          if STARTED in line]  # fmt: skip
    (root / "rolled.json").write_text(json.dumps(out, default=str))


def ladder(engine, model: str, prompts) -> dict:
    """Two levels measured as a Serve trial measures its ladder (trial/measure.py ``measure_rung``, given the
    ServeEngine): what each level kept of the front end's CPU, and the front end's processes as read."""
    from servetune.load.client import StreamingClient
    from servetune.serve.frontend import read_front_end
    from servetune.trial.measure import LevelPlan, measure_rung

    async def run() -> list:
        levels = []
        async with StreamingClient(engine.url, model, timeout_s=60, first_token_timeout_s=30, idle_timeout_s=30) as c:
            for index, load in enumerate((1.0, 3.0)):
                plan = LevelPlan(Level("concurrency", load), 9, None, 1)
                levels.append(await measure_rung(c, engine.url, WORKLOAD, prompts, plan, index, repeats=1, slo=SLO,
                                                 record=lambda _: None, engine=engine))  # fmt: skip
        return levels

    reading = read_front_end(engine.name, engine.proxy_record.get("serve_proxy_node_id", ""))
    return {"levels": [{"share": lv.frontend_cpu_share, "process": lv.frontend_process, "completed": lv.summary.completed}
                       for lv in asyncio.run(run())],
            "roles": sorted(reading.roles.values()) if reading else []}  # fmt: skip


def fresh_reader(name: str, deployed: dict) -> dict:
    """The rollout's check (serve/trial.py ``replicas_on``) in a fresh Ray worker, as in a study's verify task, and
    today's fallback (the replicas' ``LLMConfig``) in another: their answers and whether each imported vLLM."""
    import ray

    def read(fallback: bool) -> dict:
        import sys

        from servetune.serve.cluster import ServeCluster
        from servetune.serve.trial import replicas_on

        vllm = lambda: any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)  # noqa: E731
        before, cluster = vllm(), ServeCluster.attached()
        found = len(cluster.replica_llm_configs(name)) if fallback else replicas_on(cluster, name, deployed)
        return {"vllm_before": before, "found": found, "vllm_after": vllm()}

    # a worker of its own each (another runtime environment): nothing imported by an earlier task
    return {kind: ray.get(ray.remote(read).options(num_cpus=0, runtime_env={"env_vars": {"SERVETUNE_READER": kind}})
                          .remote(kind == "fallback"), timeout=300)
            for kind in ("told", "fallback")}  # fmt: skip


def ingress(cluster, name: str) -> list[str]:
    """The application's live ingress replicas (Serve's ids), from Ray's actor table."""
    return [
        life["replica"] for life in cluster.replica_lifetimes(name) if not life["engine"] and life["ended_s"] is None
    ]


@pytest.fixture(scope="module")
def rolled(tiny_model, tmp_path_factory) -> dict:
    """The update, then the lost replica, on one Ray and Serve, in a process of its own: what it wrote."""
    work = tmp_path_factory.mktemp("rolled")
    code = "import sys\nfrom tests.integration.test_rolling_update_serve import roll\nroll(sys.argv[1], sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, str(work), str(tiny_model)], cwd=ROOT, capture_output=True,
                          text=True, timeout=840)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((work / "rolled.json").read_text())


def test_a_rolling_update_to_the_runner_up_leaves_only_replicas_of_its_configuration(rolled):
    out = rolled
    n, before, after = out["numbers"], out["before"], out["after"]
    assert out["change"].startswith("to the runner-up's configuration") and n["change"] == out["change"]

    # (a) What the replicas run, as Serve's replicas hold it: the verified point's before, the runner-up's after,
    # each built on the cluster it runs on (the new replicas claim cores of their own, as the old ones did).
    assert [c["engine_kwargs"]["max_num_seqs"] for c in before["configs"]] == [4, 4]
    assert [c["env_vars"]["SERVETUNE_FAKE_TTFT_MS"] for c in before["configs"]] == ["20", "20"]
    assert [c["engine_kwargs"]["max_num_seqs"] for c in after["configs"]] == [8, 8]
    assert [c["env_vars"]["SERVETUNE_FAKE_TTFT_MS"] for c in after["configs"]] == ["60", "60"]
    assert all("ClaimCores" in str(c["callback_class"]) for c in before["configs"] + after["configs"])
    assert (n["replicas_after"], n["replicas_on_new"]) == (2, 2)
    # ... told by the replicas beside their core claims: the scenario read no replica's LLMConfig, and a fresh worker
    # reads the same answer without importing vLLM, which reading the replicas' LLMConfigs does (the fallback)
    assert out["configs_asked_by_scenario"] == 0
    told, fallback = out["fresh_reader"]["told"], out["fresh_reader"]["fallback"]
    assert told == {"vllm_before": False, "found": [2, 2], "vllm_after": False}
    assert fallback == {"vllm_before": False, "found": 2, "vllm_after": True}
    # and in the engines' own words, in the replicas' log (the old replicas' lines kept)
    started = out["started"]
    assert {s["max_num_seqs"] for s in started} == {4, 8}
    assert sum(s["max_num_seqs"] == 8 for s in started) >= 2

    # (b) None of the replicas from before is alive, in Serve's state or as a process; the rollout's time measured.
    assert len(before["replicas"]) == 2 and len(after["replicas"]) == 2
    assert not set(before["replicas"]) & set(after["replicas"])
    assert out["before_processes"] >= 2 and out["old_processes_left"] == []
    assert n["rolled_out"] and n["update_s"] > 0

    # (b2) Only the LLM deployment moved: the one ingress replica routed throughout, and the scenario says so. Serve
    # stopped the two old LLM replicas and started two new ones, after the update call and by the time it was done.
    assert len(before["ingress"]) == 1 and after["ingress"] == before["ingress"]
    changes = n["replica_changes"]
    assert n["ingress_replaced"] is False and all(c["engine"] for c in changes)
    assert sorted(c["what"] for c in changes) == ["started", "started", "stopped", "stopped"]
    assert all(c["after_update_s"] <= n["update_s"] for c in changes) and "the ingress kept" in out["reason"]

    # (c) The scenario's numbers are the records': counted again here from what the client saw.
    records = [RequestRecord(**r) for r in out["records"]]
    assert n["requests"] == len(records)
    measured = [r for r in records if not r.warmup]
    updated, done_s = n["updated_at_s"], n["updated_at_s"] + n["update_s"]
    assert any(r.sent < updated for r in measured)  # the load ran before the update
    during = [r for r in measured if r.sent < done_s and (r.end if r.end is not None else r.sent) >= updated]
    assert n["requests_during"] == len(during) > 0
    assert n["failed"] == sum(not r.ok for r in during)
    ttfts = [r.ttft_s for r in during if r.ok and r.ttft_s is not None and r.sent >= updated]
    assert n["ttft_ms_max_during"] == pytest.approx(max(ttfts) * 1000.0)
    # no request waited for a replica to start (a replica served throughout, through the same router); the worst's
    # send and answer as the scenario tells them, from the update call
    assert n["ttft_ms_max_during"] < START_S * 1000.0
    worst = max((r for r in during if r.ok and r.ttft_s is not None and r.sent >= updated), key=lambda r: r.ttft_s)
    assert n["worst_sent_after_update_s"] == pytest.approx(worst.sent - updated)
    assert n["worst_answered_after_update_s"] == pytest.approx(worst.sent + worst.ttft_s - updated)
    # after it only the runner-up's replicas answer: none sooner than its fake's 60 ms
    after_it = [r for r in measured if r.sent >= done_s]
    assert n["requests_after"] == len(after_it) > 0 and n["failed_after"] == sum(not r.ok for r in after_it)
    assert all(r.ttft_s >= RUNNER_UP_TTFT_S for r in after_it if r.ok and r.ttft_s is not None)


def test_each_level_of_a_serve_trial_keeps_its_busiest_front_end_processs_share_of_a_core(rolled):
    """Serve's front end (serve/frontend.py), read as a trial's ladder reads it: the proxy the client sends to, the
    ingress and both LLM replicas are found in Ray's actor table, and each level keeps the busiest one's CPU over the
    level (a share of a core: at most the host's cores) and which of them it was."""
    assert rolled["ladder"]["roles"] == ["ingress", "proxy", "replica", "replica"]
    levels = rolled["ladder"]["levels"]
    assert [lv["completed"] for lv in levels] == [9, 9]
    for lv in levels:
        assert lv["share"] is not None and 0.0 <= lv["share"] <= psutil.cpu_count(), levels
        assert lv["process"] in ("proxy", "ingress", "replica"), levels


def test_a_replica_lost_under_load_is_replaced_by_serve_and_the_other_serves_meanwhile(rolled):
    """verify's replica_lost on the same deployment, after the update (the module's one Ray and Serve): the killed
    replica's process is gone, Serve runs two replicas again, one of them new, no sooner than an engine's start; the
    scenario's counts are the client's records'; the surviving replica served while one was lost."""
    lost, before = rolled["lost"], rolled["after"]["replicas"]
    n = lost["numbers"]
    assert n["killed"].startswith("replica process ") and n["replaced"], lost["reason"]
    assert n["replaced_s"] >= START_S  # the replacement's engine took its start
    assert len(lost["replicas"]) == 2 and len(set(lost["replicas"]) - set(before)) == 1, (before, lost["replicas"])
    records = [RequestRecord(**r) for r in lost["records"]]
    killed_at = n["killed_at_s"]
    measured = [r for r in records if not r.warmup]
    failed = [r for r in measured if not r.ok and (r.end if r.end is not None else r.sent) >= killed_at]
    assert n["requests"] == len(records) and n["failed"] == len(failed)
    assert n["failed"] == n["failed_in_flight"] + n["failed_sent_after_kill"]
    survivors = [r for r in measured if r.ok and killed_at <= r.sent < killed_at + n["replaced_s"]]
    assert n["survivor_requests"] == len(survivors) > 0
    assert n["recovered"] and any(r.ok and r.sent >= killed_at + n["replaced_s"] for r in measured), lost["reason"]
