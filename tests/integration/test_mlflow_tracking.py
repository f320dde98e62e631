"""MLflow tracking against real stores: the local sqlite store and an ``mlflow server`` on 127.0.0.1.

Content is read back through ``MlflowClient``: params, per-step metric histories, tags,
artifacts. The Tune callback is driven by calling its hooks with stand-in trials (no Ray).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from servetune.engine.server import free_port
from servetune.report.diagnosis import limited_by
from servetune.testing.process import wait_until_healthy
from servetune.tracking import sync_study
from servetune.tracking.callback import MlflowCallback
from tests.builders import demo_trials, level, study_info, trial, write_study

SPACE = "name: {name}\nworkload: chat\nparams:\n  max_num_seqs: [16, 32, 64]\n"
REQUESTS = "".join(
    f'{{"level": {i % 2}, "warmup": {str(i < 2).lower()}, "input_tokens": 200, "prompt_tokens": {180 + i}, "output_tokens": {60 + i}, "ok": true}}\n'
    for i in range(20)
)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real tracking server with proxied artifacts, stopped by process group."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}", "--artifacts-destination", str(root / "artifacts")],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_healthy(url + "/health", proc, timeout_s=180, poll_s=0.5):
            raise RuntimeError("mlflow server did not start:\n" + (root / "server.log").read_text()[-3000:])
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)  # uvicorn waits on the client's keep-alive connections
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module", params=["sqlite", "server"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "server":
        yield request.getfixturevalue("mlflow_server")
        return
    root = tmp_path_factory.mktemp("mlflow-local")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # MLflow puts a local store's artifacts in ./mlruns
        yield f"sqlite:///{root / 'mlflow.db'}"


def make_study(root: Path, name: str, trials=None) -> Path:
    """The demo study under its own name, with a named workload, requests and engine logs."""
    trials = demo_trials() if trials is None else trials
    write_study(
        root, study_info(name=name), [t.model_copy(update={"study": name}) for t in trials], running=("t-running",)
    )
    (root / "space.yaml").write_text(SPACE.format(name=name))
    for trial_id, log in (("t16", "INFO ready\n"), ("t64", "ERROR torch.OutOfMemoryError: CUDA out of memory\n")):
        if (root / "trials" / trial_id).is_dir():
            (root / "trials" / trial_id / "engine.log").write_text(log)
    if (root / "trials" / "t16").is_dir():
        (root / "trials" / "t16" / "requests.jsonl").write_text(REQUESTS)
    return root


def add_trial(root: Path, t) -> None:
    (root / "trials" / t.trial_id).mkdir()
    (root / "trials" / t.trial_id / "result.json").write_text(
        t.model_copy(update={"study": root.name}).model_dump_json()
    )


def trial_runs(client: MlflowClient, experiment_id: str) -> dict:
    runs = client.search_runs([experiment_id], "tags.`servetune.role` = 'trial'")
    assert len(runs) == len({r.data.tags["servetune.trial_id"] for r in runs}), "a trial was logged twice"
    return {r.data.tags["servetune.trial_id"]: r for r in runs}


def test_sync_logs_a_parent_run_and_one_nested_run_per_trial(store, tmp_path):
    root = make_study(tmp_path / "content", "content")
    report = sync_study(root, store)
    assert report.ok, report.error
    assert sorted(report.logged) == ["t16", "t256", "t32", "t64"] and report.not_read == ["t-running"]
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("content")
    assert experiment.experiment_id == report.experiment_id

    parent = client.get_run(report.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["servetune.role"] == "study"
    assert parent.data.params["algorithm"] == "grid" and parent.data.params["price_per_device_hour"] == "2"
    assert parent.data.params["slo"] == "ttft_ms_p99 <= 2000; tpot_ms_p99 <= 100"
    assert "cost_per_mtok_usd (min)" in parent.data.params["objectives"]
    assert parent.data.metrics["trials_total"] == 4 and parent.data.metrics["trials_failed"] == 1
    assert parent.data.metrics["best_goodput"] == pytest.approx(20.0)
    parent_files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"space.yaml", "study.json", "workload"} <= parent_files
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "workload")] == ["workload/chat.yaml"]

    runs = trial_runs(client, report.experiment_id)
    assert set(runs) == {"t16", "t32", "t64", "t256"}
    t32 = runs["t32"]
    assert t32.data.tags["mlflow.parentRunId"] == report.parent_run_id and t32.info.status == "FINISHED"
    assert t32.data.params["max_num_seqs"] == "32" and t32.data.params["enforce_eager"] == "true"
    assert "default" not in t32.data.params.values()  # left to vLLM and not resolved: left out
    assert t32.info.run_name == "seqs=32 gpu-mem=0.9 · t32"
    history = client.get_metric_history(t32.info.run_id, "by_level/ttft_ms_p99")
    assert sorted((m.step, m.value) for m in history) == [(0, 500.0), (1, 1500.0), (2, 3000.0)]
    cost = client.get_metric_history(t32.info.run_id, "by_level/cost_per_mtok_usd")
    assert [m.step for m in sorted(cost, key=lambda m: m.step)] == [0, 1, 2]
    # the plain names hold the chosen operating point (concurrency 32), not the last level (64, SLO broken)
    assert [(m.step, m.value) for m in client.get_metric_history(t32.info.run_id, "ttft_ms_p99")] == [(0, 1500.0)]
    assert t32.data.metrics["output_throughput"] == 1200.0 and t32.data.metrics["meets_slo"] == 1.0
    assert t32.data.tags["servetune.level"] == "concurrency 32"
    assert t32.data.tags["servetune.outcome"] == "COMPLETE" and t32.data.tags["conclusion"] == "keep"
    assert t32.data.tags["servetune.recommended"] == "false"
    demo = {t.trial_id: t for t in demo_trials()}
    assert t32.data.tags["servetune.limited_by"] == limited_by(demo["t32"])  # report/diagnosis.py, as the report says
    assert t32.data.tags["quality"] == "not evaluated" and t32.data.tags["record.date"] == "unknown"
    assert "Experiment id (实验编号)" in t32.data.tags["mlflow.note.content"]

    t16 = runs["t16"]  # the recommendation: t32 is cheaper but its neighbour t64 ran out of memory
    assert t16.data.tags["servetune.recommended"] == "true"
    assert t16.data.tags["conclusion.why"].startswith("recommended to ship (stepped one notch back")
    assert parent.data.tags["servetune.recommended_trial"] == "t16"
    description = parent.data.tags["mlflow.note.content"]
    assert "**Recommended: trial t16** (seqs=16 gpu-mem=0.9) at concurrency 16" in description
    assert f"servetune export {root} --pick best --format vllm" in description
    link = f"#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=servetune-trials"
    assert link in description and link in report.summary()
    ui = store if store.startswith("http") else "http://127.0.0.1:5000"
    assert f"{ui}/{link}" in report.summary()
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(experiment.tags["mlflow.sharedViewState.servetune-trials"])
    assert view["selectedColumns"][:3] == [
        "params.`max_num_seqs`",
        "params.`gpu_memory_utilization`",
        "metrics.`goodput`",
    ]
    assert view["orderByKey"] == "metrics.`goodput`" and "servetune.role" in view["searchFilter"]
    assert {a.path for a in client.list_artifacts(t16.info.run_id)} == {
        "record.md",
        "result.json",
        "engine.log",
        "requests.jsonl",
    }
    assert t16.data.tags["requests.input_tokens_p50"] != "unknown" and t16.data.tags["requests.count"] == "18"
    record = Path(client.download_artifacts(t16.info.run_id, "record.md", str(tmp_path))).read_text()
    assert "| Conclusion (结论) |" in record and "max_num_seqs 16" in record and "${" not in record

    t64, t256 = runs["t64"], runs["t256"]
    assert t64.info.status == "FAILED" and "CUDA out of memory" in t64.data.tags["servetune.reason"]
    assert t64.data.tags["servetune.limited_by"] == "not diagnosed: FAILED"
    assert t64.data.tags["stability.oom"] == "yes" and t64.data.tags["conclusion"] == "eliminate"
    assert t256.data.tags["servetune.outcome"] == "INFEASIBLE" and t256.data.tags["stability.oom"] == "not run"
    assert {a.path for a in client.list_artifacts(t256.info.run_id)} == {"record.md", "result.json"}


def test_sync_twice_logs_nothing_twice_and_then_only_what_is_new(store, tmp_path):
    root = make_study(tmp_path / "twice", "twice")
    first = sync_study(root, store)
    again = sync_study(root, store)
    assert again.ok and again.logged == [] and sorted(again.already) == sorted(first.logged)
    assert again.parent_run_id == first.parent_run_id
    client = MlflowClient(store)
    assert len(trial_runs(client, first.experiment_id)) == 4
    assert len(client.search_runs([first.experiment_id], "tags.`servetune.role` = 'study'")) == 1

    add_trial(root, trial("t48", {"max_num_seqs": 48, "max_num_batched_tokens": 4096}, [level(24, 900, 700)],
                          env={"HF_TOKEN": "***", "VLLM_CPU_KVCACHE_SPACE": "2"}))  # fmt: skip
    third = sync_study(root, store)
    assert third.logged == ["t48"] and len(trial_runs(client, first.experiment_id)) == 5
    t48 = trial_runs(client, first.experiment_id)["t48"]
    assert t48.data.params["max_num_batched_tokens"] == "4096" and t48.info.run_name == "seqs=48 mbt=4096 · t48"
    assert "max_num_batched_tokens=4096" in t48.data.tags["record.core_parameters"].replace(" ", "=")
    assert "***" not in json.dumps([t48.data.params, t48.data.tags["record.core_parameters"]])


def test_a_trial_run_cut_short_while_logging_is_logged_again(store, tmp_path):
    root = make_study(tmp_path / "cut", "cut")
    first = sync_study(root, store)
    client = MlflowClient(store)
    # a run created but never terminated: the driver died between create_run and set_terminated
    client.delete_run(trial_runs(client, first.experiment_id)["t32"].info.run_id)
    stale = client.create_run(first.experiment_id, tags={"servetune.role": "trial", "servetune.trial_id": "t32"})
    report = sync_study(root, store)
    assert report.logged == ["t32"]
    runs = trial_runs(client, first.experiment_id)
    assert runs["t32"].info.run_id != stale.info.run_id and runs["t32"].info.status == "FINISHED"


def test_report_files_are_logged_to_the_parent_run(store, tmp_path):
    root = make_study(tmp_path / "reported", "reported")
    sync_study(root, store)
    (root / "report").mkdir()
    (root / "report" / "summary.md").write_text("# summary\n")
    report = sync_study(root, store)
    files = [a.path for a in MlflowClient(store).list_artifacts(report.parent_run_id, "report")]
    assert files == ["report/summary.md"]


def tune_trial(ray_id: str) -> SimpleNamespace:
    """What the callback gets from Tune: Ray's own id, and a last result whose trial_id is Ray's."""
    return SimpleNamespace(trial_id=ray_id, config={"params": {}}, last_result={"trial_id": ray_id})


def test_callback_logs_each_trial_as_tune_completes_it_and_survives_pickling(store, tmp_path):
    dear = trial("dear", {"max_num_seqs": 24}, [level(16, 600, 900)], devices=2)
    root = make_study(tmp_path / "live", "live", trials=[dear])
    out = StringIO()
    callback = MlflowCallback(root, store, stream=out)
    callback.setup(stop=None, num_samples=2, total_num_samples=2)
    callback.on_trial_complete(iteration=1, trials=[], trial=tune_trial("ray_0001"))
    client = MlflowClient(store)
    experiment_id = client.get_experiment_by_name("live").experiment_id
    runs = trial_runs(client, experiment_id)
    assert set(runs) == {"dear"} and runs["dear"].data.tags["conclusion"] == "keep"
    assert runs["dear"].data.tags["servetune.recommended"] == "true"

    restored = pickle.loads(pickle.dumps(callback))  # Tune checkpoints its callbacks
    assert restored.tracking_uri == callback.tracking_uri and restored._session is None
    add_trial(root, {t.trial_id: t for t in demo_trials()}["t32"])  # cheaper and faster: "dear" falls off the front
    restored.on_trial_complete(iteration=2, trials=[], trial=tune_trial("ray_0002"))
    restored.on_experiment_end(trials=[])
    assert out.getvalue() == "" and not restored.disabled
    runs = trial_runs(client, experiment_id)
    assert set(runs) == {"dear", "t32"}
    assert runs["dear"].data.tags["conclusion"] == "next round"
    assert (
        runs["dear"].data.tags["servetune.recommended"] == "false"
        and runs["t32"].data.tags["servetune.recommended"] == "true"
    )
    record = Path(client.download_artifacts(runs["dear"].info.run_id, "record.md", str(tmp_path))).read_text()
    assert "next round: meets the SLO" in record
    parent = client.search_runs([experiment_id], "tags.`servetune.role` = 'study'")
    assert len(parent) == 1 and parent[0].info.status == "FINISHED" and parent[0].data.metrics["trials_total"] == 2


def test_a_trial_that_ran_again_replaces_its_earlier_run(store, tmp_path):
    # A trial whose node was lost is FAILED on disk and logged; --resume runs it again under the
    # same id, and the new result is the one the experiment keeps (one run per trial).
    root = make_study(tmp_path / "rerun", "rerun")
    lost = trial("t48", {"max_num_seqs": 48}, outcome="FAILED", reason="the node running this trial died")
    add_trial(root, lost.model_copy(update={"started_at": "2026-12-01T06:00:00+00:00"}))
    first = sync_study(root, store)
    client = MlflowClient(store)
    assert trial_runs(client, first.experiment_id)["t48"].data.tags["servetune.outcome"] == "FAILED"
    again = trial("t48", {"max_num_seqs": 48}, [level(24, 900, 700)])
    (root / "trials" / "t48" / "result.json").write_text(
        again.model_copy(update={"study": root.name, "started_at": "2026-12-01T07:00:00+00:00"}).model_dump_json()
    )
    report = sync_study(root, store)
    assert report.replaced == ["t48"] and report.logged == ["t48"] and "1 replaced by a re-run" in report.summary()
    runs = trial_runs(client, first.experiment_id)
    assert runs["t48"].data.tags["servetune.outcome"] == "COMPLETE" and len(runs) == 5
    assert sync_study(root, store).replaced == []  # the new run holds the result: nothing to replace next time
