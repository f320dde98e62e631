"""verify, serve-check and recheck start a study's point again: its weights are fetched where its engine runs before
it starts (``--no-prefetch`` skips it), each download kept apart from the start-up in the file the command writes;
and a structured-output workload whose backend does not load is refused in one line before anything starts, as a
study refuses it before its trials. Ray, Serve and the engines are replaced at their boundary; the downloads
themselves are test_prefetch.py's."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from servetune.cli import main
from servetune.engine import args as engine_args
from servetune.engine.args import point_structured_problem
from servetune.results import LevelResult, WeightsPrefetch
from tests.builders import level, study_info, trial, write_study
from tests.unit.test_serve_check import ServedCluster, served_study  # noqa: F401  (a fixture)
from tests.unit.test_structured_backends import engine_python  # noqa: F401  (a fixture)

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")

RECORD = WeightsPrefetch(model="org/tiny-chat", node_id="local", host="here", download_s=4.0, bytes=1_000_000)
LFE = "lm-format-enforcer"


@pytest.fixture
def fetched(monkeypatch) -> list[dict[str, Any]]:
    """``prefetch_point`` replaced: each call recorded (with what had happened before it), one record returned."""
    calls: list[dict[str, Any]] = []

    def prefetch_point(model, env, engine_args, device, say, through_ray, gpu_type=None, **kwargs):
        calls.append({"model": model, "env": dict(env), "through_ray": through_ray, "device": device,
                      "deployed": [list(c.deployed) for c in ServedCluster.opened]})  # fmt: skip
        say(f"prefetch: {model} on here: 0.0 GB in 4 s")
        return [RECORD]

    monkeypatch.setattr("servetune.prefetch.prefetch_point", prefetch_point)
    return calls


def structured_study(root: Path, workload: str = "agent", backend: str = LFE) -> Path:
    """A one-trial CPU study whose trial ran ``backend`` on ``workload`` (agent's tool calls ask for JSON)."""
    t = trial("t1", {"structured_outputs_config.backend": backend}, [level(8, 400, 300)], device="cpu")
    write_study(root, study_info(device="cpu", workload=workload), [t])
    (root / "space.yaml").write_text(
        f"name: demo\nmodel: tiny\ndevice: cpu\nworkload: {workload}\n"
        "load: {levels: [8], requests_per_level: 16}\nslo: {ttft_ms: {p99: 2000}}\n"
    )  # fmt: skip
    return root


def test_serve_check_prefetches_where_the_replicas_run_before_the_first_deployment(
    served_study, fetched, monkeypatch, capsys  # noqa: F811  (the fixture imported above)
):  # fmt: skip
    def run_levels(console, url, served, workload, prompts, plans, slo, args, holder, records):
        holder.levels.append(LevelResult(summary=level(8, 380, 320).summary))

    monkeypatch.setattr("servetune.cli.bench.run_levels", run_levels)
    argv = ["serve-check", str(served_study), "--pick", "t1", "--replicas", "1"]
    assert main(argv) == 0
    (call,) = fetched
    assert call["deployed"] == [[]] and call["through_ray"] is False  # before any deployment; a local Ray: here
    assert call["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # what the replicas get
    doc = json.loads((served_study / "serve-check.json").read_text())
    assert doc["prefetch"] == [RECORD.model_dump(mode="json")]
    assert "prefetch: " in capsys.readouterr().err
    fetched.clear()
    assert main([*argv, "--no-prefetch"]) == 0
    assert fetched == [] and json.loads((served_study / "serve-check.json").read_text())["prefetch"] == []


def test_recheck_prefetches_on_this_machine_before_it_measures_and_keeps_the_download_apart(
    tmp_path, fetched, monkeypatch
):  # fmt: skip
    study = structured_study(tmp_path / "s", workload="chat")
    events: list[str] = []
    monkeypatch.setattr("servetune.verify.recheck.remeasure", lambda *a, **k: events.append(f"measure {len(fetched)}"))
    out = tmp_path / "recheck.json"
    assert main(["recheck", str(study), "--json", str(out)]) == 3  # nothing re-measured here: "not run"
    assert events == ["measure 1"] and fetched[0]["through_ray"] is False  # fetched first, on this machine
    assert json.loads(out.read_text())["prefetch"] == [RECORD.model_dump(mode="json")]
    fetched.clear()
    assert main(["recheck", str(study), "--json", str(out), "--no-prefetch"]) == 3
    assert fetched == [] and json.loads(out.read_text())["prefetch"] == []


def test_verify_hands_each_engine_start_the_prefetch_unless_told_not_to(tmp_path, fetched, monkeypatch, tiny_tokenizer):
    import servetune.verify.run as verification
    from servetune.errors import UserError

    monkeypatch.setattr("servetune.load.tokenizer.load_tokenizer", lambda model: tiny_tokenizer)

    study = structured_study(tmp_path / "s", workload="chat")
    given: list[Any] = []

    def verify(selection, *args, prefetch=None, **kwargs):
        given.append(prefetch)
        if prefetch is not None:
            prefetch(selection.winner.spec, False)
            prefetch(selection.winner.spec, False)  # the runner-up of the same model: fetched once
        raise UserError("stop here")

    monkeypatch.setattr(verification, "verify", verify)
    assert main(["verify", str(study)]) == 2
    assert len(fetched) == 1 and fetched[0]["through_ray"] is False and fetched[0]["model"] == "org/tiny-chat"
    assert main(["verify", str(study), "--no-prefetch"]) == 2
    assert given[-1] is None and len(fetched) == 1


class Engine:
    """A started engine as verify/run.py's ``started`` yields it, saying when it started."""

    def __init__(self, events: list[str], what: str) -> None:
        self.events, self.what = events, what

    def __enter__(self) -> Engine:
        self.events.append(f"{self.what} started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.append(f"{self.what} stopped")

    def nodes(self) -> list[dict[str, float]]:  # as a Ray cluster: one node, of no GPU type
        return [{"CPU": 4.0}]


def test_verify_fetches_before_each_engine_starts_here_or_on_the_cluster_it_deploys_to(tmp_path, monkeypatch):
    import servetune.verify.run as verification

    events: list[str] = []
    monkeypatch.setattr(verification, "vllm_engine", lambda spec, folder: Engine(events, "vllm"))
    monkeypatch.setattr(verification, "ServeCluster", lambda address, resources: Engine(events, f"ray at {address}"))
    monkeypatch.setattr(verification, "ServeEngine", lambda spec, folder, cluster: Engine(events, "serve"))
    monkeypatch.setattr(verification, "trial_needs", lambda spec: types.SimpleNamespace(resources=lambda: {"CPU": 1}))
    monkeypatch.setattr(verification, "_in_ray", lambda: False)

    def prefetch(spec: Any, through_ray: bool) -> None:
        events.append(f"prefetch {spec.model} {'on the cluster' if through_ray else 'here'}")

    log = tmp_path / "engine.log"
    bare = types.SimpleNamespace(spec=types.SimpleNamespace(serve_replicas=None, model="org/m"))
    with verification.started(bare, log, prefetch=prefetch):  # type: ignore[arg-type]
        pass
    assert events == ["prefetch org/m here", "vllm started", "vllm stopped"]
    spec = types.SimpleNamespace(serve_replicas=2, model="org/m", device="cpu", gpu=None, gpu_type=None, trial_id="t")
    served = types.SimpleNamespace(spec=spec, result=types.SimpleNamespace(environment={}))
    for address, where in ((None, "here"), ("10.0.0.1:6379", "on the cluster")):
        events.clear()
        with verification.started(served, log, address, prefetch=prefetch):  # type: ignore[arg-type]
            pass
        assert events == [f"ray at {address} started", f"prefetch org/m {where}", "serve started", "serve stopped",
                          f"ray at {address} stopped"]  # fmt: skip
    events.clear()
    with verification.started(served, log):  # type: ignore[arg-type]  # --no-prefetch
        pass
    assert not any(e.startswith("prefetch") for e in events)


def test_a_structured_workload_whose_backend_does_not_load_is_refused_in_one_line_before_anything_starts(
    tmp_path, capsys, engine_python, monkeypatch, fetched  # noqa: F811  (the fixture imported above)
):  # fmt: skip
    """verify and recheck ask the engines' interpreter (--python, whose lm-format-enforcer does not load beside
    vLLM); serve-check asks this one, whose replicas Ray starts."""
    if engine_args.load_argspecs() is None:
        pytest.skip("needs vLLM here: without it the engines' interpreter is not asked")
    study = structured_study(tmp_path / "s")
    for command in ("verify", "recheck"):
        assert main([command, str(study), "--python", engine_python]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert f"{study}: trial t1: structured_outputs_config.backend: {LFE}: " in err
        assert "No module named 'vllm_moved_away'" in err
    real = engine_args.structured_backend_problems
    monkeypatch.setattr(engine_args, "structured_backend_problems",
                        lambda backends, python: real(backends, engine_python))  # fmt: skip
    monkeypatch.setattr("servetune.serve.cluster.ServeCluster", ServedCluster)
    monkeypatch.setattr(ServedCluster, "opened", [])
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"trial t1: structured_outputs_config.backend: {LFE}: " in err
    assert ServedCluster.opened == [] and fetched == []  # nothing started, nothing fetched
    assert not (study / "serve-check.json").exists() and not (study / "verify.json").exists()


def test_the_backend_is_asked_only_where_the_workload_asks_for_structured_output(monkeypatch):
    asked: list[list[str]] = []

    def problems(backends: list[str], python: str) -> dict[str, str]:
        asked.append(backends)
        return dict.fromkeys(backends, "does not load")

    monkeypatch.setattr(engine_args, "structured_backend_problems", problems)
    flat = {"structured_outputs_config.backend": LFE}
    nested = {"structured_outputs_config": {"backend": "outlines"}}
    as_json = {"structured-outputs-config": json.dumps({"backend": "guidance"})}
    assert point_structured_problem(flat, False, "python") is None and asked == []
    assert point_structured_problem(flat, True, "python") == f"structured_outputs_config.backend: {LFE}: does not load"
    assert (
        point_structured_problem(nested, True, "python") == "structured_outputs_config.backend: outlines: does not load"
    )
    assert "guidance" in (point_structured_problem(as_json, True, "python") or "")
    assert point_structured_problem({"max_num_seqs": 8}, True, "python") is None  # vLLM's pick (auto)
    assert asked == [[LFE], ["outlines"], ["guidance"]]
