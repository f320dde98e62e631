"""lm-evaluation-harness tasks as quality scores: ``python -m lm_eval`` against the trial's server.

lm-eval (the optional extra ``servetune[lm-eval]``) runs as a subprocess of the trial, in its own
process group, killed at the spec's ``timeout_s``, with its ``local-completions`` model pointed
at the server's ``/v1/completions`` (the served model name, the model's own tokenizer, prompts
sent as text) and Hugging Face offline: the task's data must be on the node (a local JSONL file
named by the task's YAML, relative to ``include_path`` where lm-eval runs, or the datasets cache). Its results JSON is what is read back: each
task's primary metric (the first of the task's ``metric_list``, unfiltered where it can) is the
score ``lm_eval/<task>``, compared with the reference's like a suite's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from servetune.config.quality import LM_EVAL_PREFIX, LmEvalSpec
from servetune.errors import UserError

INSTALL_HINT = "lm-eval is not installed: pip install servetune[lm-eval]"
#: No network from a trial: the task's data and the tokenizer come from disk.
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: Seconds lm-eval may take to go after SIGKILL: one that SIGKILL does not end is stuck in the kernel, and waiting on
#: it would hang the trial for good (as the engine's stop, engine/server.py).
KILL_WAIT_S = 10.0
_FINGERPRINTED = (".yaml", ".yml", ".jsonl", ".json", ".py", ".txt")
#: Run before lm-eval's CLI (``python -c``, so the trial's node needs lm-eval, not this servetune): where every task
#: asked for is in ``--include_path``, lm-eval's index of its own thousands of task files is left out (about ten
#: core-seconds a trial on a CPU host), as :func:`check` leaves it out on the driver.
OWN_TASKS_ONLY = """
import sys
from lm_eval.tasks import TaskManager

def _arg(flag):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv[:-1] else None

_include, _tasks = _arg("--include_path"), (_arg("--tasks") or "").split(",")
if _include and set(_tasks) <= set(TaskManager(include_path=_include, include_defaults=False).all_tasks):
    _init = TaskManager.__init__

    def _own_only(self, *args, **kwargs):
        kwargs.setdefault("include_defaults", False)
        _init(self, *args, **kwargs)

    TaskManager.__init__ = _own_only
"""
LAUNCH = OWN_TASKS_ONLY + "from lm_eval.__main__ import cli_evaluate\ncli_evaluate()\n"


class LmEvalPlan(BaseModel):
    """What each trial runs (resolved on the driver): the include path is absolute and must exist on the trial's node."""

    model_config = ConfigDict(extra="ignore")

    tasks: list[str]
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    timeout_s: float = 1800.0
    fingerprint: str = ""  # a hash of the include path's task files: another task, another trial id

    @classmethod
    def from_spec(cls, spec: LmEvalSpec, base_dir: Path) -> LmEvalPlan:
        include = resolve_include_path(spec, base_dir)
        return cls(tasks=list(spec.tasks), include_path=str(include) if include else None, limit=spec.limit,
                   num_fewshot=spec.num_fewshot, timeout_s=spec.timeout_s, fingerprint=_fingerprint(include))  # fmt: skip

    def digest_key(self) -> dict[str, Any]:
        return {"tasks": self.tasks, "limit": self.limit, "num_fewshot": self.num_fewshot, "files": self.fingerprint}


@dataclass
class LmEvalOutcome:
    scores: dict[str, float] = field(default_factory=dict)  # lm_eval/<task> -> primary metric
    errors: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # a row per item, for quality.jsonl


def resolve_include_path(spec: LmEvalSpec, base_dir: Path) -> Path | None:
    if spec.include_path is None:
        return None
    path = Path(spec.include_path).expanduser()
    return (path if path.is_absolute() else base_dir / path).resolve()


def check(spec: LmEvalSpec, base_dir: Path) -> None:
    """Installed, the include path a folder, every task known to lm-eval: else a ``UserError`` naming the field."""
    if find_spec("lm_eval") is None:
        raise UserError(INSTALL_HINT)
    include = resolve_include_path(spec, base_dir)
    if include is not None and not include.is_dir():
        raise UserError(f"include_path: {include} is not a folder")
    known = _known_tasks(include, defaults=False) if include is not None else set()
    missing = [t for t in spec.tasks if t not in known]
    if missing:  # lm-eval's own tasks: indexing them takes seconds more, so only when needed
        known |= _known_tasks(include, defaults=True)
        missing = [t for t in spec.tasks if t not in known]
    if missing:
        where = (
            f" (in {include} or lm-eval's own)" if include is not None else " (lm-eval's own; include_path adds yours)"
        )
        raise UserError(f"tasks: unknown task {', '.join(repr(t) for t in missing)}{where}")


def _known_tasks(include: Path | None, defaults: bool) -> set[str]:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include) if include is not None else None, include_defaults=defaults)
    return set(manager.all_tasks)


def _fingerprint(include: Path | None) -> str:
    if include is None or not include.is_dir():
        return ""
    digest = hashlib.sha256()
    for path in sorted(p for p in include.rglob("*") if p.is_file() and p.suffix in _FINGERPRINTED):
        digest.update(str(path.relative_to(include)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def lm_eval_argv(plan: LmEvalPlan, url: str, model: str, tokenizer: str, out_dir: Path, max_length: int | None,
                 concurrency: int, python: str | None = None) -> list[str]:  # fmt: skip
    """``python -m lm_eval run`` against the server at ``url`` (an argument list: no shell), through :data:`LAUNCH`."""
    model_args = {
        "base_url": url.rstrip("/") + "/v1/completions", "model": model, "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface", "tokenized_requests": "False", "num_concurrent": str(concurrency),
        "max_retries": "1", "timeout": str(int(plan.timeout_s)),
    }  # fmt: skip
    if max_length:
        model_args["max_length"] = str(max_length)
    argv = [python or sys.executable, "-c", LAUNCH, "run", "--model", "local-completions",
            "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()), "--tasks", ",".join(plan.tasks),
            "--output_path", str(out_dir), "--log_samples", "--seed", "0"]  # fmt: skip
    if plan.include_path:
        argv += ["--include_path", plan.include_path]
    if plan.limit is not None:
        argv += ["--limit", str(plan.limit)]
    if plan.num_fewshot is not None:
        argv += ["--num_fewshot", str(plan.num_fewshot)]
    return argv


def run_lm_eval(plan: LmEvalPlan, url: str, model: str, tokenizer: str, out_dir: Path, max_length: int | None = None,
                concurrency: int = 4) -> LmEvalOutcome:  # fmt: skip
    """Run the plan's tasks on the server; never raises for lm-eval's failure (its scores are then missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = lm_eval_argv(plan, url, model, tokenizer, out_dir, max_length, concurrency)
    log_path = out_dir / "lm_eval.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **OFFLINE_ENV}, start_new_session=True,
                                   cwd=plan.include_path or out_dir)  # a task's relative data_files: beside its YAML  # fmt: skip
        try:
            code = process.wait(timeout=plan.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(process)
    if code is None:
        return LmEvalOutcome(errors=[f"lm-eval: no result after {plan.timeout_s:g} s (stopped; log in {log_path})"])
    results = results_file(out_dir)
    if code != 0 or results is None:
        return LmEvalOutcome(errors=[f"lm-eval exited {code}: {_last_line(log_path)}"])
    try:
        data = json.loads(results.read_text())
        scores, errors = primary_scores(data, plan.tasks)
        return LmEvalOutcome(scores=scores, errors=errors, rows=sample_rows(results.parent, plan.tasks, data))
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # a results file lm-eval did not finish
        return LmEvalOutcome(errors=[f"lm-eval: unreadable {results.name}: {type(exc).__name__}: {str(exc)[:200]}"])


def results_file(out_dir: Path) -> Path | None:
    """The results JSON lm-eval wrote last under ``out_dir`` (``<model>/results_<time>.json``)."""
    found = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime) if out_dir.is_dir() else []
    return found[-1] if found else None


def _kill_group(process: subprocess.Popen, wait_s: float = KILL_WAIT_S) -> None:
    """lm-eval and anything it started: stopped whatever happened (it runs in its own process group), waited for
    ``wait_s`` at most."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=wait_s)


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def primary_metric(data: dict[str, Any], task: str) -> tuple[str, str] | None:
    """(metric, results key) of a task's primary metric: the first of its ``metric_list``, the ``none`` filter first."""
    values = data.get("results", {}).get(task)
    if not isinstance(values, dict):
        return None
    metrics = [
        m.get("metric") for m in (data.get("configs", {}).get(task, {}).get("metric_list") or []) if isinstance(m, dict)
    ]
    keys = [k for k in values if "," in k and "_stderr," not in k and isinstance(values[k], (int, float))]
    for metric in [m for m in metrics if isinstance(m, str)] or sorted({k.split(",", 1)[0] for k in keys}):
        found = [k for k in keys if k.split(",", 1)[0] == metric]
        if found:
            return metric, (f"{metric},none" if f"{metric},none" in found else found[0])
    return None


def primary_scores(data: dict[str, Any], tasks: list[str]) -> tuple[dict[str, float], list[str]]:
    """``lm_eval/<task>`` -> its primary metric from lm-eval's results JSON, and why any task has none."""
    scores: dict[str, float] = {}
    errors: list[str] = []
    for task in tasks:
        found = primary_metric(data, task)
        if found is None:
            errors.append(f"lm-eval: no metric for task {task} in its results")
            continue
        metric, key = found
        value = float(data["results"][task][key])
        higher = data.get("higher_is_better", {}).get(task, {}).get(metric, True)
        if higher is False or not 0.0 <= value <= 1.0:
            errors.append(f"lm-eval: task {task}'s {metric} ({value:g}) is not a 0..1 score where higher is better")
            continue
        scores[LM_EVAL_PREFIX + task] = value
    return scores, errors


def sample_rows(folder: Path, tasks: list[str], data: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``quality.jsonl`` row per item lm-eval logged: prompt, answer, and the primary metric's value."""
    rows: list[dict[str, Any]] = []
    for task in tasks:
        found = primary_metric(data, task)
        samples = sorted(folder.glob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        if found is None or not samples:
            continue
        metric = found[0]
        for line in samples[-1].read_text().splitlines():
            sample = json.loads(line)
            arguments = sample.get("arguments") or {}
            first = arguments.get("gen_args_0", arguments) if isinstance(arguments, dict) else arguments
            prompt = first.get("arg_0") if isinstance(first, dict) else first
            answer = (sample.get("filtered_resps") or [None])[0]
            value = sample.get(metric)
            rows.append({"suite": LM_EVAL_PREFIX + task, "id": f"{task}-{sample.get('doc_id')}", "prompt": prompt,
                         "answer": answer, "target": sample.get("target"),
                         "passed": bool(value) if isinstance(value, (int, float, bool)) else None})  # fmt: skip
    return rows
