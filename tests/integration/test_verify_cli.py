"""``servetune verify`` on a stored study: bad input is one line and exit 2 with nothing started;
an engine that dies during verification fails the configuration with its log tail (the fake
engine stands in for vLLM)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.testing.fake_openai import write_fake_python
from tests.processes import processes_mentioning

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"  # the one trial of the stored study meeting the SLO
BROKEN = "18ae6e731937"  # completed, broke the SLO at its only level


@pytest.fixture
def study(tmp_path):
    root = tmp_path / "study"
    shutil.copytree(STUDY, root)
    return root


def servetune(*argv, env=None, timeout=300, cwd=None):
    return subprocess.run([sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)  # fmt: skip


def set_outcome(study, trial_id, outcome, reason):
    path = study / "trials" / trial_id / "result.json"
    data = json.loads(path.read_text())
    data.update(outcome=outcome, reason=reason)
    path.write_text(json.dumps(data))


def one_line_exit_2(done, *words):
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("servetune verify: error:"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def nothing_started(study):
    assert not (study / "verify").exists() and not (study / "verify.json").exists()
    assert processes_mentioning(study) == []


def test_a_row_out_of_range(study):
    one_line_exit_2(servetune("verify", study, "--pick", "7"), "--pick 7", "rows 0-")
    nothing_started(study)


def test_no_completed_trial(study):
    for trial_dir in (study / "trials").iterdir():
        set_outcome(study, trial_dir.name, "FAILED", "engine start: vLLM exited with code 1")
    one_line_exit_2(servetune("verify", study), "no completed trial")
    nothing_started(study)


def test_a_failed_trial_picked(study):
    set_outcome(study, WINNER, "FAILED", "the engine died during concurrency 32 (RuntimeError: boom)")
    one_line_exit_2(servetune("verify", study, "--pick", WINNER), WINNER, "FAILED", "only a completed trial")
    nothing_started(study)


def test_no_configuration_met_the_slo(study):
    path = study / "trials" / WINNER / "result.json"
    data = json.loads(path.read_text())
    for level in data["levels"]:
        level["slo_violations"] = ["ttft_ms_p99 = 900 > 300"]
    path.write_text(json.dumps(data))
    one_line_exit_2(servetune("verify", study), "--pick best: nothing to verify", "no configuration met every SLO")
    nothing_started(study)


def test_a_trial_that_never_met_the_slo(study):
    one_line_exit_2(servetune("verify", study, "--pick", BROKEN), BROKEN, "never met the SLO")
    nothing_started(study)


def test_not_a_study_and_a_bad_duration(tmp_path, study):
    one_line_exit_2(servetune("verify", tmp_path / "nowhere"), "no such study directory")
    one_line_exit_2(servetune("verify", study, "--duration", "0"), "--duration")


def test_without_vllm_nothing_starts(study, tmp_path):
    python = tmp_path / "python-without-vllm"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')  # no site-packages: no vLLM
    python.chmod(0o755)
    one_line_exit_2(servetune("verify", study, "--python", python), "vLLM is not installed")
    nothing_started(study)


def test_an_engine_that_dies_fails_the_configuration_with_its_log_tail(study, tmp_path):
    """...and the verdict reaches the trial's MLflow run in the store the study recorded (study.json's tracking_uri),
    run from another directory without --tracking-uri: nothing is written to a store the user did not name."""
    pytest.importorskip("vllm", reason="verify asks the interpreter behind the fake engine for vLLM")
    from mlflow import MlflowClient

    from servetune.tracking import sync_study

    store = f"sqlite:///{tmp_path / 'study-store.db'}"
    assert sync_study(study, store).ok
    info = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**info, "tracking_uri": store}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fake = write_fake_python(tmp_path)
    out = tmp_path / "out" / "verify.json"
    done = servetune("verify", study, "--python", fake, "--duration", "30", "--no-runner-up", "--json", out,
                     env={"SERVETUNE_FAKE_CRASH_AFTER_S": "6", "MLFLOW_TRACKING_URI": ""}, cwd=elsewhere)  # fmt: skip
    # (6 s after it started serving: well into the soak, which begins about a second after the engine is up)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "REJECTED" in done.stderr
    doc = json.loads(out.read_text())
    assert doc["trial_id"] == WINNER and doc["level"] == {"concurrency": 8.0} and doc["accepted"] is False
    soak = doc["scenarios"]["soak"]
    assert not soak["passed"] and "the engine died during soak" in soak["reason"] and "fake engine" in soak["log_tail"]
    assert soak["duration_s"] < 20, soak["duration_s"]  # the soak stopped once the engine was gone, not at its 30 s
    assert all(doc["scenarios"][name]["reason"].startswith("not run") for name in ("peak", "disconnects", "repeats"))
    # what limited it here, from the soak it measured (the peak did not run), printed and kept beside the study's
    assert f"in this verification, what limited it (soak and peak): {doc['limited_by']}" in done.stderr
    assert doc["scenarios"]["peak"]["limited_by"].startswith("not diagnosed: the scenario measured no level")
    assert doc["limited_by"] == doc["scenarios"]["soak"]["limited_by"] and doc["limited_by_in_study"]
    assert set(doc["stability"]) >= {"cancellation_success_rate", "p99_jitter", "oom", "error_rate_5xx"}
    assert doc["stability"]["cancellation_success_rate"] is None  # never measured, never made up
    assert processes_mentioning(study) == [] and processes_mentioning(fake) == []
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("cpu-tiny").experiment_id],
                                f"tags.`servetune.trial_id` = '{WINNER}'")  # fmt: skip
    assert run.data.metrics["verify.accepted"] == 0.0 and "stability.oom" in run.data.metrics, run.data.metrics
    assert list(elsewhere.iterdir()) == []  # no mlflow.db where it ran


@pytest.mark.parametrize(("how", "name", "status"), [("SIGTERM", "SIGTERM", 143), ("Ctrl-C", "interrupted", 130)])
def test_a_verification_stopped_with_sigterm_or_ctrl_c_keeps_the_scenarios_that_finished_and_leaves_nothing_running(
        study, tmp_path, how, name, status):  # fmt: skip
    """`ray job stop`, a scheduler's preemption, a user's kill or Ctrl-C: the engine is stopped, and verify.json holds
    what finished (no verdict: not accepted, and MLflow is not told one), with the exit status of the signal. Ctrl-C
    is SIGINT to the terminal's foreground process group (the command's own, not the engine's)."""
    import os
    import signal
    import time

    pytest.importorskip("vllm", reason="verify asks the interpreter behind the fake engine for vLLM")
    fake = write_fake_python(tmp_path)
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "servetune", "verify", str(study), "--python", str(fake), "--duration", "6",
                                 "--no-runner-up", "--tracking-uri", str(tmp_path / "mlruns")],
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "soak:" not in err_path.read_text():  # the soak's verdict: the peak has begun
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(1.0)
            if how == "SIGTERM":
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    stderr = err_path.read_text()
    assert proc.returncode == status and "Traceback" not in stderr, stderr[-3000:]
    assert f"servetune verify: stopped ({name})" in stderr and "MLflow" not in out, (out, stderr)
    doc = json.loads((study / "verify.json").read_text())
    assert doc["stopped"] == name and doc["accepted"] is False
    assert doc["reasons"][0] == f"stopped ({name}) after 1 of 8 scenarios: not a verdict", doc["reasons"]
    scenarios = doc["scenarios"]
    assert not scenarios["soak"]["reason"].startswith("not run") and scenarios["soak"]["ttft_ms_p99"] > 0, scenarios[
        "soak"
    ]
    assert scenarios["peak"]["reason"] == f"not run: the verification was stopped ({name}) during it"
    assert all(
        scenarios[n]["reason"] == f"not run: the verification was stopped ({name})" for n in ("burst", "repeats")
    )
    assert doc["stability"]["requests"] > 0  # the soak's and the peak's requests, as sent
    assert processes_mentioning(study) == [] and processes_mentioning(fake) == []
    from servetune.report.verification import read_verify_file, verification

    assert (
        verification(study, read_verify_file(study)).verdict == "no verdict recorded"
    )  # the report says: stopped, no verdict
