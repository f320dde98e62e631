"""What the quality probe costs a trial on the CPU stand-in, against what the trial spends measuring.

Starts the tiny model with cpu-tiny's engine arguments (search_spaces/cpu-tiny.yaml), runs the
probe with the default suites twice on that engine (once as the reference, once as a trial
compared with it: the trial's run adds the teacher-forced scoring of the reference's tokens),
and prints the seconds against the mean measuring time of a cpu-tiny trial on the recorded
surface (bench/data/cpu-tiny-grid-r4.json: its levels' measured seconds).

    python bench/quality_probe.py [--repeats 3] [--surface bench/data/cpu-tiny-grid-r4.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from servetune.config.quality import QualitySpec
from servetune.engine.server import VllmServer
from servetune.load.requests import PromptFactory
from servetune.load.tokenizer import load_tokenizer
from servetune.models.tiny import build_tiny_model
from servetune.quality.probe import make_plan, run_probe
from servetune.space_file import load_space

ROOT = Path(__file__).resolve().parents[1]


def measuring_seconds(surface: Path) -> list[float]:
    trials = json.loads(surface.read_text())["trials"]
    return [sum(level["summary"]["duration_s"] for level in t["levels"]) for t in trials if t["levels"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--surface", type=Path, default=ROOT / "bench" / "data" / "cpu-tiny-grid-r4.json")
    args = parser.parse_args()
    space = load_space(ROOT / "search_spaces" / "cpu-tiny.yaml")
    spec = QualitySpec()  # the default suites
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny"))
        count = PromptFactory(load_tokenizer(model)).count
        env = {k: str(v) for k, v in space.env.items()}
        with VllmServer(
            model, dict(space.engine_args), env, log_path=Path(tmp) / "engine.log", startup_timeout_s=600
        ) as server:
            plan = make_plan(spec, ROOT, {})
            as_reference, as_trial = [], []
            for _ in range(args.repeats):
                started = time.monotonic()
                result, _ = asyncio.run(run_probe(server.url, model, plan, count, "reference", {}))
                as_reference.append(time.monotonic() - started)
                compared = plan.model_copy(update={"reference": result.reference_answers})
                started = time.monotonic()
                trial, rows = asyncio.run(run_probe(server.url, model, compared, count, "trial", {}))
                as_trial.append(time.monotonic() - started)
                assert trial.agreement == 1.0, "the same engine must agree with itself"
    measured = measuring_seconds(args.surface)
    probe = statistics.median(as_trial)
    print(f"suites: {', '.join(spec.suites)}; {len(rows)} prompts; {args.repeats} runs each")
    print(
        f"probe as the reference: median {statistics.median(as_reference):.1f} s (runs: {', '.join(f'{s:.1f}' for s in as_reference)})"
    )
    print(f"probe as a trial:       median {probe:.1f} s (runs: {', '.join(f'{s:.1f}' for s in as_trial)})")
    print(f"a cpu-tiny trial measures {statistics.median(measured):.0f} s (median of {len(measured)} trials, "
          f"{min(measured):.0f} to {max(measured):.0f} s; {args.surface.name})")  # fmt: skip
    print(f"probe / measuring time: {probe / statistics.median(measured):.1%} of the median trial, "
          f"{probe / min(measured):.1%} of the shortest")  # fmt: skip


if __name__ == "__main__":
    main()
