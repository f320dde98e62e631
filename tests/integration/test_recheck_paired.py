"""``recheck --paired`` measuring for real against fake OpenAI servers (no vLLM): two engines measured round by round,
their order alternating, with a host that drifts between rounds; then the command end to end on the stored study,
with the fake engine standing in for vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT
from servetune.testing.fake_openai import FakeOpenAI, write_fake_python
from servetune.trial.runner import TrialSpec
from servetune.verify.paired import judge, measure_pairs
from tests.conftest import serve_fake
from tests.processes import processes_mentioning

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"  # the stored study's recommendation, shipped at concurrency 8
OTHER = "8aede7346995"  # another completed trial (it broke the SLO at concurrency 2 when the study ran)


class CountingEngine:
    """The trial runner's Engine protocol over an in-process fake server; counts its starts."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake, self.starts, self.url = fake, 0, ""
        self.process = SimpleNamespace(pid=os.getpid())
        self.startup_s = 0.01

    def __enter__(self) -> CountingEngine:
        self.starts += 1
        self._serving = serve_fake(self.fake)
        self.url = self._serving.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._serving.__exit__(None, None, None)

    def kv_capacity(self):
        return None

    def alive(self) -> bool:
        return True

    def failure_reason(self) -> str:
        return ""

    def log_tail(self, lines: int = 40) -> str:
        return ""


def spec(tmp_path: Path, name: str, device: str = "cpu") -> TrialSpec:
    return TrialSpec(
        study="paired", trials_dir=tmp_path, params={}, engine_args={"max_num_seqs": 8}, env={"SIDE": name},
        model="fake-model", device=device, devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"),
        levels=(Level("concurrency", 4),), requests_per_level=24, seconds_per_level=None, warmup_requests=2,
        request_timeout_s=30, startup_timeout_s=30, stop_on_slo_break=True, min_throughput_gain=0.0,
        slo=Slo.parse("ttft_ms.p99=2000"),
    )  # fmt: skip


#: The host's speed in each round after the first, as a factor on every delay (both engines alike): the
#: 10.4 -> 22.4 req/s swing the speculative-decoding study saw between two runs, and back.
HOST = [2.2, 0.6, 1.5]


def drifting(*fakes: FakeOpenAI):
    base = [(f.ttft_s, f.itl_s) for f in fakes]

    def on_round(done) -> None:
        factor = HOST[done.round % len(HOST)]
        for fake, (ttft, itl) in zip(fakes, base, strict=True):
            fake.ttft_s, fake.itl_s = ttft * factor, itl * factor

    return on_round


def run_pairs(tmp_path, tokenizer, fake_a, fake_b, rounds=3, device="cpu"):
    engines = {"A": CountingEngine(fake_a), "B": CountingEngine(fake_b)}
    a, b = spec(tmp_path, "a", device), spec(tmp_path, "b", device)
    by_spec = {a.trial_id: engines["A"], b.trial_id: engines["B"]}
    prompts = PromptFactory(tokenizer)
    done = measure_pairs(a, b, Level("concurrency", 4), rounds, tmp_path / "paired", {"A": prompts, "B": prompts},
                         engine=lambda s, d: by_spec[s.trial_id], on_round=drifting(fake_a, fake_b))  # fmt: skip
    return done, engines, (a, b)


def test_a_slower_configuration_loses_every_round_through_the_host_s_drift(tmp_path, tiny_tokenizer):
    # The fake sleeps to a schedule, so a loaded host does not scale its pace: it stalls it, adding time once to the
    # level it hits (bench/fake_pace_noise.py, bench/README.md). What keeps B behind is the gap between the two levels'
    # times: 24 requests 4 at a time, 31 gaps each, at the fastest round (x 0.6) 6 x 31 x (15 - 3) x 0.6 ms = 1.34 s.
    # At 2 against 3.5 ms it was 0.17 s, and a clean-clone run's stall of about 0.5 s made B faster (goodput 32.1
    # against 24.8: A's level took 0.97 s); at 9 ms it was 0.67 s. B at 15 ms adds about 4 s to the test.
    done, engines, (a, b) = run_pairs(tmp_path, tiny_tokenizer, FakeOpenAI(ttft_ms=10, itl_ms=3),
                                      FakeOpenAI(ttft_ms=10, itl_ms=15))  # fmt: skip
    assert [r.first for r in done] == ["A", "B", "A"]
    assert engines["A"].starts == engines["B"].starts == 1  # side by side on the CPU build: each started once
    assert engines["A"].fake.resets == engines["B"].fake.resets == 3  # one level run per round each
    a_goodput = [r.a[GOODPUT] for r in done]
    assert max(a_goodput) / min(a_goodput) > 1.5  # the drift, far larger than the gap between the two
    _, decided, verdict, reason = judge(done)
    assert decided == GOODPUT and verdict == "A better", reason
    assert all(r.b[GOODPUT] < r.a[GOODPUT] for r in done)
    for side, one in (("A", a), ("B", b)):  # each side's request records, tagged with their round
        rows = [json.loads(line) for line in (tmp_path / "paired" / f"{side}-{one.trial_id}" / "requests.jsonl").open()]
        assert {row["round"] for row in rows} == {0, 1, 2}


def test_one_configuration_against_itself_is_a_tie_through_the_drift(tmp_path, tiny_tokenizer):
    done, _, _ = run_pairs(tmp_path, tiny_tokenizer, FakeOpenAI(ttft_ms=10, itl_ms=3), FakeOpenAI(ttft_ms=10, itl_ms=3))
    metrics, _, verdict, reason = judge(done)
    assert verdict == "tie within the paired noise", reason
    assert {m.metric: m for m in metrics}[OUTPUT_THROUGHPUT].verdict == "tie"


def test_on_gpus_each_round_starts_the_engines_one_after_the_other(tmp_path, tiny_tokenizer):
    done, engines, _ = run_pairs(tmp_path, tiny_tokenizer, FakeOpenAI(ttft_ms=5, itl_ms=1),
                                 FakeOpenAI(ttft_ms=5, itl_ms=1), rounds=2, device="gpu")  # fmt: skip
    assert len(done) == 2 and engines["A"].starts == engines["B"].starts == 2


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="recheck asks the interpreter behind the fake engine for vLLM's version and argument table",
)


@needs_vllm
def test_the_command_measures_the_pick_against_another_trial_and_logs_it(tmp_path):
    from mlflow import MlflowClient

    from servetune.tracking import sync_study

    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    store = f"sqlite:///{tmp_path / 'study-store.db'}"
    assert sync_study(study, store).ok
    info = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**info, "tracking_uri": store}))
    path = study / "trials" / OTHER / "result.json"
    # the other configuration's engine answers its first token later, past the study's TTFT bounds (P95 150 ms, P99
    # 300): its goodput falls away in every round. At 120 ms, under the P95 bound, a busy host's stalls decided it
    # (a flake census round at load 21, 2026-12-08: B/A goodput 0.50, 0.61, 0.81, a tie within the paired noise)
    recorded = json.loads(path.read_text())
    recorded["params"]["env.SERVETUNE_FAKE_TTFT_MS"] = "400"
    path.write_text(json.dumps(recorded))
    fake = write_fake_python(tmp_path)
    done = subprocess.run([sys.executable, "-m", "servetune", "recheck", str(study), "--paired", "--against", OTHER,
                           "--python", str(fake)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "A better: goodput" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("round ") >= 3  # a line per round as it ends
    (written,) = study.glob("recheck-paired-*.json")
    doc = json.loads(written.read_text())
    assert (doc["a_trial_id"], doc["b_trial_id"], doc["level"]) == (WINNER, OTHER, {"concurrency": 8.0})
    assert doc["mode"] == "side by side" and [r["first"] for r in doc["rounds"]] == ["A", "B", "A"]
    assert doc["verdict"] == "A better" and doc["decided_on"] == GOODPUT
    assert all(r["b"]["ttft_ms_p99"] > r["a"]["ttft_ms_p99"] for r in doc["rounds"])
    assert processes_mentioning(study) == [] and processes_mentioning(fake) == []
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("cpu-tiny").experiment_id
    (run,) = client.search_runs([experiment], "tags.`recheck.mode` = 'paired'")
    assert run.data.tags["recheck.verdict"] == "A better" and run.data.tags["recheck.against"] == OTHER
    goodput = next(m for m in doc["metrics"] if m["metric"] == GOODPUT)
    assert run.data.metrics["paired.goodput.change"] == pytest.approx(goodput["change"])


@needs_vllm
def test_a_refused_paired_run_keeps_its_result_in_a_run_folder_of_its_own(tmp_path):
    """Nothing starts where the new vLLM refuses a side; the result is kept in ``recheck/<vllm>/<run>/`` as a measured
    run's is, so the next paired run, which overwrites the study-level file, loses nothing."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    space = yaml.safe_load((study / "space.yaml").read_text())
    space["engine_args"]["disable_log_requests"] = True  # left vLLM before 0.32
    (study / "space.yaml").write_text(yaml.safe_dump(space))
    for trial in (WINNER, OTHER):
        path = study / "trials" / trial / "result.json"
        recorded = json.loads(path.read_text())
        recorded["engine_args"]["disable_log_requests"] = True
        path.write_text(json.dumps(recorded))
    fake = write_fake_python(tmp_path)
    done = subprocess.run([sys.executable, "-m", "servetune", "recheck", str(study), "--paired", "--against", OTHER,
                           "--python", str(fake)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": ""})  # fmt: skip
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (written,) = study.glob("recheck-paired-*.json")
    doc = json.loads(written.read_text())
    assert doc["verdict"] == "REFUSED" and "disable_log_requests" in doc["failure"] and doc["result_dir"] is None
    (run,) = (study / "recheck").glob("*/*")
    assert [p.name for p in run.iterdir()] == ["recheck-paired.json"]
    assert json.loads((run / "recheck-paired.json").read_text()) == doc and processes_mentioning(fake) == []
