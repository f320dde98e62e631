"""``search.verify: {top: K}``: the study ends with ``servetune verify``'s scenarios on its K best points.

The points are :func:`servetune.verify.choose.top_points`'s: the recommendation, then the other
candidates cheapest first, one per trial; fewer when fewer trials met every SLO (said so). Each
runs as a Ray task inside a placement group of the trial's own bundle (trial/context.py
``bundle``: TP x PP x DP GPUs and ``cpus_per_trial`` CPUs on one node, or TP x DP cores on CPU),
so the driver needs no GPU and the engine sees exactly the GPUs Ray reserved
(``CUDA_VISIBLE_DEVICES`` from ``ray.get_gpu_ids()``, as a trial's). As many run at once as
``search.max_concurrent`` resolves to (one at a time on CPU); a point no node can hold is
rejected at once with the reason, as an INFEASIBLE trial is. A trial measured through Ray Serve
(``serve.num_replicas``) is verified as that Serve application, deployed on the study's Serve from
a task that holds its load client's CPU; its replicas' devices come from the study's ledger
(``device_ledger.py``), as a trial's do.

Each result is ``STUDY/verify/<trial id>.json`` (``servetune verify``'s document, plus
``settings`` and ``placement``), written by the driver from what the task returns (nodes share no
disk: the engine log's end comes back too, to ``STUDY/verify/<trial id>/engine.log``).
``--resume`` keeps a document whose ``settings`` (trial, level, parameters, budget) are the same,
whatever its verdict; an engine that failed is a finished, rejected verification. A task that
did not return (its node died) leaves no file: ``--resume`` runs it again. A point no longer among
the top K (a resumed study found better ones, or asks for fewer) has its files moved to
``STUDY/verify/superseded/``, kept but out of the report. Progress (each step,
each scenario's verdict) comes to the driver through a Ray queue while the tasks run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servetune.errors import UserError
from servetune.trial.context import StudyContext
from servetune.verify.choose import Selection
from servetune.verify.scenarios import Budget

VERIFY_DIR = "verify"
#: How much of a verification's engine log comes back to the driver (its end, where a failure shows).
ENGINE_LOG_CARRIED = 1 << 20


def document_path(study_dir: Path, trial_id: str) -> Path:
    return Path(study_dir) / VERIFY_DIR / f"{trial_id}.json"


def settings(selection: Selection, budget: Budget, rank: int) -> dict[str, Any]:
    """What makes two verifications the same one: the trial, its level, its parameters, the budget.

    As JSON gives it back (a level's value may be an int or a float), so a stored document compares equal.
    """
    winner = selection.winner
    value = {"trial_id": winner.trial_id, "level": dict(winner.point.level), "params": dict(winner.result.params),
             "budget": asdict(budget)}  # fmt: skip
    return json.loads(json.dumps(value, default=str)) | {"rank": rank}


def kept_document(path: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The stored verification at ``path`` when it finished with these settings (``rank`` aside), else None."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    stored = doc.get("settings") if isinstance(doc, dict) else None
    if not isinstance(stored, dict) or "accepted" not in doc:
        return None
    same = {k: v for k, v in stored.items() if k != "rank"} == {k: v for k, v in wanted.items() if k != "rank"}
    return doc if same else None


@dataclass
class Verified:
    """One point's verification as the study ends: its document, where it is, and whether it ran now."""

    trial_id: str
    path: Path
    doc: dict[str, Any] | None  # None: the task did not return (``problem`` says why)
    ran: bool
    problem: str = ""

    @property
    def accepted(self) -> bool:
        return bool(self.doc and self.doc.get("accepted"))


class QueueProgress:
    """verify's Progress, sent to the driver through a Ray queue (never blocks the measurement)."""

    def __init__(self, queue: Any, trial_id: str) -> None:
        self.queue, self.trial_id = queue, trial_id

    def _put(self, item: tuple) -> None:
        with contextlib.suppress(Exception):  # a full or gone queue loses a progress line, never the verification
            self.queue.put_nowait((self.trial_id, *item))

    def step(self, text: str, seconds: float | None = None) -> None:
        self._put(("step", text, seconds))

    def scenario(self, name: str, passed: bool, reason: str) -> None:
        self._put(("scenario", name, passed, reason))


def holder(trial_id: str) -> str:
    """A verification's name in the study's device ledger (a trial's is its trial id)."""
    return f"verify-{trial_id}"


def verify_on_node(selection: Selection, context: StudyContext, budget: Budget, queue: Any) -> dict[str, Any]:
    """The Ray task: verify ``selection.winner`` on the devices Ray reserved for this task.

    Returns ``{"doc": verify's document, "engine_log": its end, "placement": where it ran}``.
    """
    import ray

    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.study.driver import normal_priority
    from servetune.verify.run import verify

    normal_priority()
    runtime = ray.get_runtime_context()
    gpu_ids = [str(g) for g in ray.get_gpu_ids()] if context.space.device == "gpu" else None
    winner = selection.winner
    spec = context.spec_for(dict(winner.result.params), gpu_ids, node_id=runtime.get_node_id())
    local = Path(tempfile.mkdtemp(prefix="servetune-verify-"))  # this node's disk: nothing is shared
    selection = dataclasses.replace(
        selection, study_dir=local, winner=dataclasses.replace(winner, spec=spec), runner_up=None
    )
    prompts = PromptFactory(load_tokenizer(spec.tokenizer))
    held: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if spec.serve_replicas is not None:  # deployed through the study's Serve: its devices from the study's ledger
        from servetune.device_ledger import devices_held, replica_share

        held = devices_held(context.ledger, holder(winner.trial_id), *replica_share(spec))
    with held:
        doc = verify(selection, budget, prompts, QueueProgress(queue, winner.trial_id), runner_up=False)
    log = local / VERIFY_DIR / winner.trial_id / "engine.log"
    placement = {
        "node_id": runtime.get_node_id(),
        "placement_group_id": runtime.get_placement_group_id(),
        "assigned_resources": {k: v for k, v in runtime.get_assigned_resources().items() if not k.startswith("node:")},
        "cuda_visible_devices": spec.extra_env.get("CUDA_VISIBLE_DEVICES"),
        "cpu_binding": doc.get("engine", {}).get("cpu_binding"),  # the cores its engine's ranks ran on
        "pid": os.getpid(),
    }
    return {"doc": doc, "engine_log": _tail(log), "placement": placement}


def _tail(path: Path) -> str | None:
    if not path.is_file():
        return None
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - ENGINE_LOG_CARRIED, 0))
        text = f.read().decode(errors="replace")
    return (
        text
        if size <= ENGINE_LOG_CARRIED
        else f"[servetune: the engine log's last {ENGINE_LOG_CARRIED} of {size} bytes]\n" + text
    )


def unplaceable_document(selection: Selection, budget: Budget, problem: str) -> dict[str, Any]:
    """A rejection before anything starts: no node of the cluster can hold the point's bundle."""
    from servetune.verify.document import EngineRun, Timeouts, document

    winner = selection.winner
    run = EngineRun(winner.trial_id, Path("-"), failure=f"placement: {problem}")
    timeouts = Timeouts.from_slo(winner.spec.slo, winner.spec.request_timeout_s)
    from servetune.verify import scenarios as sc

    scenarios = {name: sc.ScenarioResult(name, False, f"not run: placement: {problem}") for name in sc.SCENARIOS}
    return document(selection, budget, timeouts, run, scenarios, [])


SUPERSEDED_DIR = "superseded"


def set_aside_superseded(study_dir: Path, top: set[str], say: Callable[[str], None]) -> None:
    """Move the verification of each point no longer among the top (a resumed study found better ones,
    or asks for fewer) to ``verify/superseded/``, out of the report, where it is kept."""
    here = Path(study_dir) / VERIFY_DIR
    stale = sorted(p for p in here.glob("*.json") if p.stem not in top)
    if not stale:
        return
    aside = here / SUPERSEDED_DIR
    aside.mkdir(exist_ok=True)
    for path in stale:
        for item in (path, here / path.stem):  # its document and its engine log's directory
            if item.exists():
                target = aside / item.name
                if target.is_dir():
                    shutil.rmtree(target)
                item.replace(target)
    one = len(stale) == 1
    say(f"verify: trial{'' if one else 's'} {', '.join(p.stem for p in stale)} {'is' if one else 'are'} no longer among "
        f"the points to verify: {'its' if one else 'their'} verification moved to {aside}")  # fmt: skip


def verify_top(study_dir: Path, context: StudyContext, say: Callable[[str], None], start_ray: Callable[[], object],
               tracking_uri: str | None = None) -> list[Verified]:  # fmt: skip
    """Verify the study's ``search.verify.top`` best points through Ray (``start_ray`` connects, called
    only when a point is left to verify); see the module docstring."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from servetune.study.nodes import alive_nodes, placement_problem
    from servetune.study.packing import resolve_max_concurrent
    from servetune.tracking.stability import log_stability
    from servetune.trial.context import bundle, pinned_gpu_type
    from servetune.verify import document as recorded
    from servetune.verify.choose import select_top

    space = context.space
    wanted = space.search.verify
    assert wanted is not None
    try:
        selections = select_top(study_dir, wanted.top, context.python)
    except UserError as exc:  # the study's files do not rebuild a configuration: said, and the report is still written
        say(f"verify: cannot verify: {exc}")
        return [Verified("-", Path(study_dir) / VERIFY_DIR, None, ran=False, problem=str(exc))]
    set_aside_superseded(study_dir, {s.winner.trial_id for s in selections}, say)
    if not selections:
        from servetune.report import build_report, load_study

        say(f"verify: nothing to verify: {build_report(load_study(study_dir)).recommendation.reason}")
        return []
    if len(selections) < wanted.top:
        say(
            f"verify: top {wanted.top} asked, but only {len(selections)} trial(s) met every SLO: verifying {len(selections)}"
        )
    budget = Budget.for_device(space.device, wanted.duration_s)
    out: list[Verified] = []
    pending: list[tuple[int, Selection, dict[str, Any]]] = []
    for rank, selection in enumerate(selections):
        trial_id = selection.winner.trial_id
        path = document_path(study_dir, trial_id)
        mine = settings(selection, budget, rank)
        kept = kept_document(path, mine)
        if kept is not None:
            verdict = "accepted" if kept.get("accepted") else "rejected"
            say(f"verify: trial {trial_id} was verified with these settings already ({verdict}): kept {path}")
            out.append(Verified(trial_id, path, kept, ran=False))
        else:
            pending.append((rank, selection, mine))
    if not pending:
        return out
    start_ray()
    nodes = alive_nodes()
    at_once = max(
        resolve_max_concurrent(space, [n.get("GPU" if space.device == "gpu" else "CPU", 0.0) for n in nodes]), 1
    )
    queue = Queue(maxsize=10_000, actor_options={"num_cpus": 0})  # the head may have no CPU to give
    ledger = None
    if (
        space.through_serve and at_once > 1
    ):  # verifications through Serve take their devices from a ledger, as trials do
        from servetune.device_ledger import ledger_name, start_ledger

        ledger_id = ledger_name(space.name)
        context = dataclasses.replace(context, ledger=ledger_id)
        ledger = start_ledger(ledger_id, space.device, space.hardware.devices_per_node)
    task = ray.remote(verify_on_node)
    running: dict[Any, tuple[int, Selection, dict[str, Any], Any]] = {}

    def finish(selection: Selection, mine: dict[str, Any], doc: dict[str, Any] | None, log: str | None,
               placement: dict[str, Any] | None, problem: str = "") -> None:  # fmt: skip
        trial_id = selection.winner.trial_id
        path = document_path(study_dir, trial_id)
        if doc is None:
            say(f"verify: trial {trial_id} did not finish ({problem}); --resume runs it again")
            out.append(Verified(trial_id, path, None, ran=True, problem=problem))
            return
        if log is not None:
            log_path = path.parent / trial_id / "engine.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            from servetune.trial.runner import write_atomic

            write_atomic(log_path, log)
            doc["engine"]["log"] = str(log_path)
        doc["settings"], doc["placement"] = mine, placement
        items = recorded.checklist(selection, doc)
        if items is not None:
            doc["checklist"] = items
        recorded.write_document(doc, path)
        verdict = "ACCEPTED" if doc["accepted"] else "REJECTED"
        say(f"verify: trial {trial_id} {verdict}: " + "; ".join(doc["reasons"]) + f" ({path})")
        logged = log_stability(tracking_uri, selection.info.name, trial_id, doc["stability"], doc["accepted"], path,
                               doc.get("limited_by"))  # fmt: skip
        say("verify: " + logged)
        out.append(Verified(trial_id, path, json.loads(path.read_text()), ran=True))

    def start(rank: int, selection: Selection, mine: dict[str, Any]) -> None:
        trial_id = selection.winner.trial_id
        params = dict(selection.winner.result.params)
        needed = bundle(space, params, pinned_gpu_type(space, nodes, params))
        problem = placement_problem(needed, nodes)
        if problem:
            finish(selection, mine, unplaceable_document(selection, budget, problem), None, None)
            return
        group = placement_group([needed], strategy="STRICT_PACK", name=f"servetune-verify-{trial_id}")
        strategy = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
        ref = task.options(num_cpus=needed.get("CPU", 0.0), num_gpus=needed.get("GPU", 0.0), scheduling_strategy=strategy,
                           max_retries=0).remote(selection, context, budget, queue)  # fmt: skip
        say(f"verify: trial {trial_id} (point {rank + 1} of {len(selections)}) at {selection.winner.level}: waiting for "
            + ", ".join(f"{v:g} {k}" for k, v in needed.items()) + " on one node")  # fmt: skip
        running[ref] = (rank, selection, mine, group)

    def drain() -> None:
        while not queue.empty():
            try:
                trial_id, kind, *rest = queue.get_nowait()
            except Exception:  # empty after all
                return
            if kind == "step":
                text, seconds = rest
                say(f"verify: trial {trial_id}: {text}" + (f" (about {seconds:.0f} s)" if seconds else ""))
            else:
                name, passed, reason = rest
                say(f"verify: trial {trial_id}: {'PASS' if passed else 'FAIL'} {name}: {reason}")

    try:
        while pending or running:
            while pending and len(running) < at_once:
                start(*pending.pop(0))
            if not running:
                continue
            done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            drain()
            for ref in done:
                rank, selection, mine, group = running.pop(ref)
                try:
                    value = ray.get(ref)
                    finish(selection, mine, value["doc"], value["engine_log"], value["placement"])
                except Exception as exc:  # a task that died is said so; the study ends with its report
                    lines = str(exc).strip().splitlines()
                    finish(
                        selection,
                        mine,
                        None,
                        None,
                        None,
                        f"{type(exc).__name__}: {lines[-1][:300] if lines else 'no message'}",
                    )
                    if space.through_serve:  # its Serve application, never deleted, would keep its devices
                        from servetune.serve.trial import app_name, delete_left_app

                        delete_left_app(app_name(context.spec_for(dict(selection.winner.result.params))))
                finally:
                    remove_placement_group(group)
                    if ledger is not None:  # a task that died gave nothing back (nor stopped its wait)
                        from servetune.device_ledger import give_back

                        give_back(ledger, holder(selection.winner.trial_id))
        drain()
    finally:
        for *_, group in running.values():
            remove_placement_group(group)
        ray.kill(queue.actor)  # type: ignore[arg-type]  # ray types Queue.actor as handle | class; it is the handle
        if ledger is not None:
            ray.kill(ledger)
    order = {s.winner.trial_id: i for i, s in enumerate(selections)}
    return sorted(out, key=lambda v: order[v.trial_id])
