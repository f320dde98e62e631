"""verify's stability numbers land on the verified trial's MLflow run (a real sqlite store);
a study never logged, or an unreachable server, is one line and nothing raised."""

import json
import shutil
from pathlib import Path

from mlflow import MlflowClient

from servetune.engine.server import free_port
from servetune.tracking import sync_study
from servetune.tracking.stability import log_stability
from servetune.tracking.writer import TRIAL_TAG

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"


def test_stability_on_the_trial_run(tmp_path):
    study = tmp_path / "cpu-tiny"
    shutil.copytree(STUDY, study)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sync_study(study, uri).ok
    verify_file = tmp_path / "verify.json"
    verify_file.write_text(json.dumps({"trial_id": WINNER}))
    stability = {"cancellation_success_rate": 0.75, "p99_jitter": 1.4, "oom": False, "error_rate_5xx": 0.0}
    limited = "KV-bound at concurrency 10: 6 preemptions, KV cache peak 97% → more KV cache"  # verify.json's line
    line = log_stability(
        uri, "cpu-tiny", WINNER, stability, accepted=False, verify_file=verify_file, limited_by=limited
    )
    assert "stability logged" in line, line
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cpu-tiny")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`{TRIAL_TAG}` = '{WINNER}'")
    metrics = run.data.metrics
    assert metrics["stability.cancellation_success_rate"] == 0.75 and metrics["stability.p99_jitter"] == 1.4
    assert (
        metrics["stability.oom"] == 0.0
        and metrics["stability.error_rate_5xx"] == 0.0
        and metrics["verify.accepted"] == 0.0
    )
    assert run.data.tags["verify.accepted"] == "no" and run.data.tags["verify.limited_by"] == limited
    assert run.data.tags["servetune.limited_by"] != limited  # the study's line stays beside it
    assert [a.path for a in client.list_artifacts(run.info.run_id, "verify")] == ["verify/verify.json"]
    others = client.search_runs([experiment.experiment_id], f"tags.`{TRIAL_TAG}` != '{WINNER}'")
    assert others and all("stability.p99_jitter" not in r.data.metrics for r in others)  # only the verified trial's


def test_nothing_to_log_to_is_one_line(tmp_path):
    stability = {"cancellation_success_rate": None, "p99_jitter": None, "oom": True, "error_rate_5xx": None}
    missing = log_stability(f"sqlite:///{tmp_path / 'none.db'}", "cpu-tiny", WINNER, stability, accepted=False)
    assert "no store" in missing and not (tmp_path / "none.db").exists()  # nothing created behind the user's back
    down = log_stability(f"http://127.0.0.1:{free_port()}", "cpu-tiny", WINNER, stability, accepted=False)
    assert "unreachable" in down and "\n" not in down
