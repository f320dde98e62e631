"""``servetune recheck`` catches a changed default on real vLLM (CPU build): issue 42, item 6's proof on CPU.

Only one vLLM CPU build installs here, so the "new release" is the same build with one of its own defaults moved
the way a release moves it: in vLLM's code, not in servetune's configuration. A vLLM general plugin (the
``vllm.general_plugins`` entry point, which vLLM loads in its API server, engine core and workers) replaces
``EngineArgs.get_batch_defaults`` so that the CPU build's ``vllm serve`` default ``max_num_seqs`` is another number
(128 in 0.32.0; ``--max-num-seqs``, 256 by default). The plugin sits in a directory of its own with a wrapper
interpreter that puts it on ``PYTHONPATH``: the upgrade candidate, handed to recheck as ``--vllm-python``, as a user
hands over a new virtual environment. The study's space, the stored results and servetune's launch are untouched;
vLLM itself reports the other value at ``/server_info``.

Steps: record a one-trial study on the tiny model (vLLM's defaults: the baseline; ~3 min), or reuse one with
``--study``; then ``servetune recheck`` twice: on the vLLM as installed (expect PASS, or REGRESSED by the host's
noise: never CHANGED-DEFAULTS) and through the candidate (expect CHANGED-DEFAULTS naming ``max_num_seqs``, exit 4).
Prints what each saw; exits 1 on a wrong verdict. Run it under the heavy lock:

    flock /tmp/servetune-heavy.lock .venv/bin/python bench/recheck_defaults_vllm.py [--study DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPACE = """\
name: recheck-defaults
description: one trial (vLLM's defaults) for bench/recheck_defaults_vllm.py
model: tiny
device: cpu
workload: cpu-tiny
load: {levels: [2, 4], requests_per_level: 16, repeats: 3, capacity_levels: 0, startup_timeout_s: 300}
slo: {ttft_ms: {p99: 5000}}
hardware: {devices_per_node: 2}
engine_args: {enforce_eager: true, max_model_len: 512, dtype: float32}
env: {VLLM_CPU_KVCACHE_SPACE: 1}
params:
  max_num_batched_tokens: [1024]
search: {algorithm: grid, num_trials: 1, max_concurrent: 1}
"""

PLUGIN = "servetune_bench_defaults"

PLUGIN_MODULE = '''\
"""A vLLM general plugin: the CPU build's `vllm serve` default max_num_seqs is {seqs} a rank (bench/recheck_defaults_vllm.py)."""


def register():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    original = EngineArgs.get_batch_defaults.__func__
    if getattr(original, "moved_by_bench", False):
        return

    def get_batch_defaults(cls, world_size):
        tokens, seqs = original(cls, world_size)
        return tokens, {{**seqs, UsageContext.OPENAI_API_SERVER: {seqs} * world_size}}

    get_batch_defaults.moved_by_bench = True
    EngineArgs.get_batch_defaults = classmethod(get_batch_defaults)
'''

ASK_DEFAULT = """\
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.usage.usage_lib import UsageContext
load_general_plugins()
print(EngineArgs.get_batch_defaults(1)[1][UsageContext.OPENAI_API_SERVER])
"""


def candidate(root: Path, python: str, seqs: int) -> Path:
    """The upgrade candidate: ``root/python``, the same vLLM with the plugin on its path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{PLUGIN}.py").write_text(PLUGIN_MODULE.format(seqs=seqs))
    info = root / f"{PLUGIN}-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nmoved_default = {PLUGIN}:register\n")
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def default_seqs(python: str | Path) -> int:
    """What that interpreter's vLLM takes for ``vllm serve``'s max_num_seqs on one rank, plugins loaded."""
    out = subprocess.run([str(python), "-c", ASK_DEFAULT], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def servetune(*argv: str, log: Path) -> int:
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "servetune", *argv], stdout=out, stderr=subprocess.STDOUT)
    print(f"  servetune {argv[0]}: exit {done.returncode} in {time.monotonic() - started:.0f} s (log {log})")
    return done.returncode


def record_study(out: Path) -> Path:
    space = out / "space.yaml"
    space.write_text(SPACE)
    print("recording a one-trial study (vLLM's defaults) on the tiny model")
    storage = out / "results"
    rc = servetune("run", str(space), "--storage", str(storage), "--max-trials", "1",
                   "--tracking-uri", f"sqlite:///{out / 'mlflow.db'}", log=out / "run.log")  # fmt: skip
    if rc != 0:
        sys.exit(f"servetune run failed (exit {rc}): see {out / 'run.log'}")
    return storage / "recheck-defaults"


def recorded_resolved(study: Path) -> dict:
    """The resolved engine arguments of the study's completed trials (the one recheck re-measures among them)."""
    found = {}
    for result in sorted(study.glob("trials/*/result.json")):
        doc = json.loads(result.read_text())
        if doc.get("outcome") == "COMPLETE":
            found[doc["trial_id"]] = doc.get("resolved_engine_args") or {}
    return found


def recheck(study: Path, python: str | Path, label: str, out: Path, repeats: int | None) -> tuple[int, dict]:
    written = out / f"recheck-{label}.json"
    argv = ["recheck", str(study), "--pick", "shipped", "--vllm-python", str(python), "--json", str(written)]
    rc = servetune(*argv, *(["--repeats", str(repeats)] if repeats else []), log=out / f"recheck-{label}.log")
    doc = json.loads(written.read_text()) if written.is_file() else {}
    print(f"  verdict {doc.get('verdict')}: " + "; ".join(doc.get("reasons", [])))
    for c in doc.get("changes", []):
        load = ", ".join(f"{k} {v:g}" for k, v in c["level"].items())
        print(f"    {c['metric']:<18} {load:<14} {c['before']:>9.4g} -> {c['after']:<9.4g} {c['change']:+7.1%} "
              f"(noise {c['margin']:.0%}){' worse' if c['worse'] else ''}{' [shipped]' if c['shipped'] else ''}")  # fmt: skip
    for a in doc.get("arguments", []):
        print(f"    argument {a['name']} ({a['kind']}): {a['before']} -> {a['after']}")
    if doc.get("resolved_note"):
        print(f"    resolved arguments not compared: {doc['resolved_note']}")
    return rc, doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, help="a recorded study to reuse (default: record one in --out)")
    parser.add_argument("--out", type=Path, help="working directory (default: a new one under /tmp, kept)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with the installed vLLM")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the candidate's default max_num_seqs a rank")
    parser.add_argument("--repeats", type=int, help="runs of each level in the rechecks (default: the study's)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each step as it ends, also into a file
    out = args.out or Path(tempfile.mkdtemp(prefix="recheck-defaults-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the study's own store, as recheck finds it
    installed = default_seqs(args.python)
    moved = candidate(out / "candidate", args.python, args.max_num_seqs)
    now = default_seqs(moved)
    print(f"vllm serve's CPU default max_num_seqs: {installed} installed, {now} through {moved}")
    if now == installed or now != args.max_num_seqs:
        print("the candidate's default did not move: the plugin was not loaded")
        return 1
    study = args.study or record_study(out)
    resolved = recorded_resolved(study)
    print(f"study {study}: resolved engine arguments per completed trial: {resolved}")
    if not any(r.get("max_num_seqs") == installed for r in resolved.values()):
        print(f"no completed trial recorded max_num_seqs resolved to {installed}: nothing to compare against")
        return 1
    wrong = []
    print("recheck on the vLLM as installed")
    rc, doc = recheck(study, args.python, "as-installed", out, args.repeats)
    if rc not in (0, 1) or doc.get("verdict") not in ("PASS", "REGRESSED") or doc.get("arguments"):
        wrong.append(f"as installed: exit {rc}, {doc.get('verdict')} (expected PASS or REGRESSED, no argument moved)")
    elif doc.get("resolved_note"):
        wrong.append(f"as installed: the resolved arguments were not compared ({doc['resolved_note']})")
    print(f"recheck through the candidate (max_num_seqs default {now})")
    rc, doc = recheck(study, moved, "moved-default", out, args.repeats)
    named = [a for a in doc.get("arguments", []) if a["name"] == "max_num_seqs" and a["kind"] == "resolved"]
    if rc != 4 or doc.get("verdict") != "CHANGED-DEFAULTS" or not named or named[0]["after"] != now:
        wrong.append(f"moved default: exit {rc}, {doc.get('verdict')}, max_num_seqs listed as {named} "
                     f"(expected exit 4, CHANGED-DEFAULTS naming max_num_seqs {installed} -> {now})")  # fmt: skip
    for line in wrong:
        print(f"WRONG: {line}")
    print("OK: the moved default was caught" if not wrong else f"{len(wrong)} wrong verdict(s); files in {out}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
