"""A start that failed for its node's fault is not started again on that node (trial/runner.py), and the study asks
Ray for any other node with the negated node-id label (study/elsewhere.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.errors import EngineStartError
from servetune.load.runner import Level
from servetune.study.elsewhere import NODE_ID_LABEL, excluding
from servetune.trial.runner import TrialSpec, run_trial

ECC_LOG = "INFO 12-05 07:00:09 Starting to load model m...\ntorch.AcceleratorError: CUDA error: uncorrectable ECC error encountered\n"
PORT_LOG = "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use\n"


def spec(tmp_path: Path) -> TrialSpec:
    return TrialSpec(
        study="s", trials_dir=tmp_path, params={}, engine_args={"max_num_seqs": 8}, env={}, model="m", device="cpu",
        devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"), levels=(Level("concurrency", 2),),
        requests_per_level=8, seconds_per_level=None, warmup_requests=None, request_timeout_s=60, startup_timeout_s=60,
        stop_on_slo_break=True, min_throughput_gain=0.0, slo=Slo.model_validate({}), node_id="a" * 56,
    )  # fmt: skip


class FailingEngine:
    """An engine whose start fails with the given log lines, each start counted."""

    starts = 0

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, spec: TrialSpec, trial_dir: Path) -> FailingEngine:
        return self

    def __enter__(self) -> FailingEngine:
        type(self).starts += 1
        raise EngineStartError("vLLM exited with code 1 during startup", self.log)

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch):
    monkeypatch.setattr("servetune.trial.runner.time.sleep", lambda s: None)
    FailingEngine.starts = 0


def test_a_node_fault_is_not_started_again_on_its_node_and_names_the_node(tmp_path):
    result = run_trial(spec(tmp_path), lambda m: None, lambda: None, engine=FailingEngine(ECC_LOG))
    assert FailingEngine.starts == 1 and result.outcome == "FAILED" and not result.retried
    assert result.failure.cause == "gpu_fault" and result.failure.retry_elsewhere
    assert result.failure.node_id == "a" * 56


def test_a_port_collision_is_started_again_on_its_own_node_with_the_node_recorded(tmp_path):
    result = run_trial(spec(tmp_path), lambda m: None, lambda: None, engine=FailingEngine(PORT_LOG))
    assert FailingEngine.starts == 3  # the first start and INFRA_RETRIES more, all here
    assert [f.cause for f in result.retried] == ["port_in_use", "port_in_use"]
    assert all(f.node_id == "a" * 56 for f in [*result.retried, result.failure])


def test_the_label_selector_names_every_node_to_avoid_in_rays_syntax():
    from ray._private.label_utils import validate_label_selector

    one, two = excluding(["a" * 56], 2), excluding(["a" * 56, "b" * 56], 1)
    assert one == [{NODE_ID_LABEL: "!" + "a" * 56}] * 2 and two == [{NODE_ID_LABEL: f"!in({'a' * 56}, {'b' * 56})"}]
    for selector in [*one, *two]:
        assert validate_label_selector(selector) is None  # Ray's own check: None means valid
