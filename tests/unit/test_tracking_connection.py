"""The preamble the one-run MLflow loggers share (tracking/connection.py ``log_to_study``): each refusal is one
line naming the store and what was not logged, and the logging is not asked for."""

from __future__ import annotations

import pytest
from mlflow.exceptions import MlflowException

from servetune.engine.server import free_port
from servetune.tracking.connection import log_to_study


def never(client, experiment_id):
    raise AssertionError("log_to_study asked for the logging after a refusal")


def test_a_sqlite_file_that_is_not_there_is_not_created(tmp_path):
    uri = f"sqlite:///{tmp_path / 'none.db'}"
    line = log_to_study(uri, "demo", "widgets", never, no_store_hint=" (pass --tracking-uri)")
    assert (
        line == f"MLflow: no store at {uri} (the study was not logged there): widgets not logged (pass --tracking-uri)"
    )
    assert not (tmp_path / "none.db").exists()


def test_a_server_that_does_not_answer_is_one_line():
    uri = f"http://127.0.0.1:{free_port()}"
    line = log_to_study(uri, "demo", "widgets", never)
    assert line.startswith(f"MLflow {uri}: widgets not logged (MLflow at {uri} is unreachable (") and "\n" not in line


@pytest.fixture
def store(tmp_path, monkeypatch):
    """MLflow's file store holding one experiment, ``demo`` (a SQLite store costs seconds to build its tables;
    what is tested here is the same on both)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    return uri, MlflowClient(uri).create_experiment("demo")


def test_a_study_never_logged_there_has_no_experiment(store):
    uri, _ = store
    assert log_to_study(uri, "other", "widgets", never) == f"MLflow {uri}: no experiment 'other': widgets not logged"


def test_the_logging_is_handed_the_study_s_experiment_and_its_failure_is_one_line(store):
    uri, experiment_id = store
    handed = []

    def log(client, experiment_id):
        handed.append(experiment_id)
        return "3 widgets logged"

    assert log_to_study(uri, "demo", "widgets", log) == f"MLflow {uri}: 3 widgets logged"
    assert handed == [experiment_id]

    def fails(client, experiment_id):
        raise MlflowException("the store refused\nover two lines")

    assert (
        log_to_study(uri, "demo", "widgets", fails)
        == f"MLflow {uri}: widgets not logged (the store refused over two lines)"
    )
