"""The Tune callback that records a running study in MLflow (a sink is a hook: see STYLE.md).

It runs on the driver, the only MLflow writer: trials write their directories, and when Tune
reports a trial complete the callback logs every finished trial on disk that MLflow does not
hold yet (so a trial Tune reported without our id, or one finished before a restore, is not
missed). When the experiment ends it refreshes conclusions, logs the study summary and ends
the parent run. If MLflow cannot be used the study goes on: one line says so and how to upload
later, and the callback stops trying.

The study's record is opened beside the first trial, not before it: a new sqlite store creates
its tables first (7-10 s on a two-core host), and Tune starts no trial until ``setup`` returns.
``setup`` starts the opening on a thread of its own; the first hook that logs waits for it, and
the end of each of Tune's steps takes its outcome once it is there, so a tracking URI that cannot
be used is said as soon as that is known. The thread is not a daemon: a study stopped while a store
is being created leaves the store whole, not half its tables.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TextIO, TypeVar

from ray.tune import Callback
from ray.tune.stopper import Stopper

from servetune.errors import UserError
from servetune.tracking.connection import (
    TRACKING_ERRORS,
    TrackingUnavailable,
    describe_error,
    mlflow_env,
    resolve_tracking_uri,
)
from servetune.tracking.sync import StudySync, SyncReport

#: What makes the tracker stop logging for the rest of the study (MLflow unreachable, a bad store URI).
GIVE_UP_ON: tuple[type[BaseException], ...] = (*TRACKING_ERRORS, UserError)

T = TypeVar("T")


def open_study(study_dir: Path, tracking_uri: str, report: SyncReport) -> StudySync:
    """The study's record in MLflow, found or created (with the store's tables, for a new store)."""
    with mlflow_env(bounded=True):
        session = StudySync(study_dir, tracking_uri)
        session.open(report)
    return session


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """``work()`` on a thread of its own (not a daemon: the interpreter lets it finish); its result
    or what it raised comes back through the future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever asks the future for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name).start()
    return future


class MlflowCallback(Callback):
    """``MlflowCallback(study_dir, tracking_uri)``: one parent run per study, one nested run per trial."""

    def __init__(self, study_dir: Path | str, tracking_uri: str | None = None, stream: TextIO | None = None) -> None:
        self.study_dir = Path(study_dir)
        self.tracking_uri = tracking_uri  # resolved (made absolute) at setup
        self.stream = stream  # where the one warning line goes (default: stderr at the time)
        self.disabled = False
        self.warning: str | None = None
        self.report: SyncReport | None = None
        self._session: StudySync | None = None
        self._opening: Future[StudySync] | None = None  # the session being opened, until a hook takes it

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles callbacks into its experiment state: an MLflow client is not data.
        return {"study_dir": self.study_dir, "tracking_uri": self.tracking_uri, "disabled": self.disabled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        MlflowCallback.__init__(self, state["study_dir"], state["tracking_uri"])
        self.disabled = state["disabled"]

    # --- Tune hooks --------------------------------------------------------------------------

    def setup(
        self,
        stop: Stopper | None = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:
        """Start opening the study's record (see the module): Tune starts the first trial meanwhile."""
        if not self.disabled and self._session is None and self._opening is None:
            try:
                self._opening = self._open_in_background()
            except GIVE_UP_ON as exc:
                self._give_up(exc)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if self._opening is not None and self._opening.done():
            self._run(lambda session, report: None)  # the session, or the one line saying why there is none

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._run(lambda session, report: session.log_new(report))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        # The trial process died: whatever it wrote to disk (if anything) is still worth logging.
        self._run(lambda session, report: session.log_new(report))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        def finish(session: StudySync, report: SyncReport) -> None:
            session.log_new(report)
            session.finish(report, end=True)

        self._run(finish)

    # --- the rest ----------------------------------------------------------------------------

    def _open_in_background(self) -> Future[StudySync]:
        self.tracking_uri = resolve_tracking_uri(self.tracking_uri)
        report = self.report = SyncReport(self.study_dir, self.tracking_uri)
        uri, study_dir = self.tracking_uri, self.study_dir
        return in_background(lambda: open_study(study_dir, uri, report), "servetune-mlflow-open")

    def _run(self, step: Callable[[StudySync, SyncReport], None]) -> None:
        if self.disabled:
            return
        try:
            if self._session is None:
                opening = self._opening or self._open_in_background()  # none: a callback Tune restored
                self._opening = None
                self._session = opening.result()  # waits for it; raises what opening it raised
            assert self.report is not None
            with mlflow_env(bounded=True):  # entered after the opening's own has ended: they share os.environ
                step(self._session, self.report)
        except GIVE_UP_ON as exc:
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self.disabled = True
        self._session = None
        cause = str(exc) if isinstance(exc, TrackingUnavailable) else f"MLflow logging stopped ({describe_error(exc)})"
        uri_flag = f" --tracking-uri {self.tracking_uri}" if self.tracking_uri else ""
        self.warning = (f"{cause}: the study goes on and its results stay in {self.study_dir}; "
                        f"log them later with: servetune report {self.study_dir} --log-to-mlflow{uri_flag}")  # fmt: skip
        print(self.warning, file=self.stream or sys.stderr, flush=True)
