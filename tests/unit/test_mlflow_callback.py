"""The MLflow callback opens the study's record beside the first trial, not before it, and a
failure to open it still ends logging with one line (tests/integration/test_mlflow_tracking.py
logs to real stores through it)."""

from __future__ import annotations

import threading
from io import StringIO
from types import SimpleNamespace
from typing import ClassVar

import pytest

from servetune.tracking.callback import MlflowCallback
from servetune.tracking.connection import TrackingUnavailable
from tests.builders import demo_study


class SlowStore:
    """StudySync's stand-in: opening waits until the test lets it end (then fails with ``fails``, if
    set); every step is written down in ``events``, beside what the test records of Tune's."""

    events: list[str]
    release: threading.Event
    fails: BaseException | None

    def __init__(self, study_dir, tracking_uri) -> None:
        self.tracking_uri = tracking_uri

    def open(self, report) -> None:
        self.release.wait(timeout=30)  # a guard: a study that waited on the store fails on the order of events
        if self.fails is not None:
            self.events.append("store failed")
            raise self.fails
        self.events.append("store created")

    def log_new(self, report) -> None:
        self.events.append("trial logged")

    def finish(self, report, end: bool = True) -> None:
        self.events.append("study finished")


@pytest.fixture
def store(monkeypatch):
    class Store(SlowStore):
        events: ClassVar[list[str]] = []
        release = threading.Event()
        fails = None

    monkeypatch.setattr("servetune.tracking.callback.StudySync", Store)
    return Store


def a_trial(i: int) -> SimpleNamespace:
    return SimpleNamespace(trial_id=f"ray_{i}", config={"params": {}}, last_result={"trial_id": f"ray_{i}"})


def test_the_first_trial_starts_while_the_store_is_created(store, tmp_path):
    out = StringIO()
    callback = MlflowCallback(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", stream=out)
    callback.setup(stop=None, num_samples=2, total_num_samples=2)
    store.events.append("first trial started")  # what Tune does once setup has returned
    callback.on_step_end(iteration=1, trials=[])  # Tune's steps go on while the store is created
    store.events.append("step ended")
    store.release.set()
    callback.on_trial_complete(iteration=2, trials=[], trial=a_trial(0))  # the first log waits for the store
    callback.on_experiment_end(trials=[])
    assert store.events == ["first trial started", "step ended", "store created", "trial logged", "trial logged",
                            "study finished"]  # fmt: skip
    assert out.getvalue() == "" and not callback.disabled


def test_a_store_that_fails_is_one_line_at_the_next_step_and_nothing_is_logged(store, tmp_path):
    url = "http://127.0.0.1:9"
    store.fails = TrackingUnavailable(f"MLflow at {url} is unreachable (Connection refused)")
    out = StringIO()
    callback = MlflowCallback(tmp_path, url, stream=out)
    callback.setup(stop=None, num_samples=2, total_num_samples=2)
    callback.on_step_end(iteration=1, trials=[])  # still opening: nothing to say yet
    assert out.getvalue() == "" and not callback.disabled
    store.release.set()
    opening = callback._opening
    assert opening is not None and isinstance(opening.exception(timeout=60), TrackingUnavailable)
    callback.on_step_end(iteration=2, trials=[])  # the step after it failed says so, before any trial ends
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and callback.disabled
    assert lines[0].startswith(f"MLflow at {url} is unreachable (Connection refused): the study goes on")
    assert f"servetune report {tmp_path} --log-to-mlflow --tracking-uri {url}" in lines[0]
    callback.on_trial_complete(iteration=3, trials=[], trial=a_trial(0))
    callback.on_experiment_end(trials=[])
    assert store.events == ["store failed"] and len(out.getvalue().splitlines()) == 1


def test_a_failure_of_another_kind_is_raised_on_the_driver(store, tmp_path):
    store.fails = RuntimeError("a bug in opening the record")
    store.release.set()
    callback = MlflowCallback(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", stream=StringIO())
    callback.setup(stop=None, num_samples=1, total_num_samples=1)
    with pytest.raises(RuntimeError, match="a bug in opening the record"):
        callback.on_trial_complete(iteration=1, trials=[], trial=a_trial(0))


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/a-file/mlflow.db", "nosuchscheme://{tmp}/mlflow"])
def test_a_bad_tracking_uri_is_one_line_and_writes_nothing(tmp_path, uri):
    """The real MLflow, opening in the background as in a study."""
    study = demo_study(tmp_path / "demo")
    (tmp_path / "a-file").write_text("where the store's directory should be")
    before = sorted(tmp_path.rglob("*"))
    uri = uri.format(tmp=tmp_path)
    out = StringIO()
    callback = MlflowCallback(study, uri, stream=out)
    callback.setup(stop=None, num_samples=1, total_num_samples=1)
    callback.on_trial_complete(iteration=1, trials=[], trial=a_trial(0))
    callback.on_experiment_end(trials=[])
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and callback.disabled
    assert lines[0].startswith("MLflow logging stopped (") and f"--log-to-mlflow --tracking-uri {uri}" in lines[0]
    assert sorted(tmp_path.rglob("*")) == before
