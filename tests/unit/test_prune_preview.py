"""``run --dry-run`` under ``search.estimate.prune``: which grid points the estimate would prune, why, and what it saves."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from servetune.cli import main
from servetune.config.workload import mean_lengths
from servetune.space_file import load_space
from servetune.study.forecast import forecast
from servetune.study.prune import error_margins, judge_prune, preview_prune, shipped_error
from servetune.trial.context import StudyContext, resolve_levels, startup_budget_for

SUMMARY = re.compile(r"search\.estimate\.prune: (\d+) of (\d+) trial\(s\) would be pruned")
SAVED = re.compile(r"about ([\d,.]+) GPU-min saved by the estimate")

GPU_SPACE = """\
name: preview
model: meta-llama/Llama-3.1-8B-Instruct
workload: chat
device: gpu
hardware: {gpu: H100-SXM}
engine_args: {max_model_len: 4096}
params: {max_num_seqs: [2, 8, 64]}
slo: {ttft_ms: {p99: 2000}}
load: {kind: concurrency, levels: [16, 64]}
search: {algorithm: grid, baseline: false, estimate: {prune: true}}
"""


def dry_run(path: Path, tmp_path: Path, capsys) -> str:
    assert main(["run", str(path), "--dry-run", "--storage", str(tmp_path / "results")]) == 0
    assert not (tmp_path / "results").exists(), "a dry run wrote to the storage"
    return " ".join(capsys.readouterr().out.split())


def test_the_dry_run_marks_the_points_the_studys_own_rule_prunes_with_the_numbers(tmp_path, capsys, no_ray):
    path = tmp_path / "space.yaml"
    path.write_text(GPU_SPACE)
    out = dry_run(path, tmp_path, capsys)

    space = load_space(path)
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path / "s", space.model, resolve_levels(space, workload))
    lengths = mean_lengths(workload)
    margins, _ = error_margins(shipped_error("gpu"), {})
    verdicts, saved_s = {}, 0.0
    for params in space.grid()[0]:
        spec = context.spec_for(params)
        forecasts = forecast(spec, lengths)
        assert not isinstance(forecasts, str)
        record = judge_prune(forecasts, space.slo_bounds, margins, [], spec.price_per_device_hour, spec.devices)
        preview = preview_prune(spec, lengths, startup_budget_for(space, params, spec.model).expected_s)
        assert (preview.record is None) == (record is None)  # the dry run's verdict is the study's rule
        verdicts[params["max_num_seqs"]] = record
        if record is not None:
            assert record.rule == "slo" and all(level.missed for level in record.levels)
            assert preview.device_s > 0
            saved_s += preview.device_s
            for level in record.levels:  # the optimistic figure and the bound it misses, level by level
                assert level.missed in out
    pruned = [seqs for seqs, record in verdicts.items() if record is not None]
    assert pruned and len(pruned) < len(verdicts), f"the space should split: {verdicts}"
    assert out.count("would be pruned:") == len(pruned)
    assert "even widened by its error (" in out and "ttft_ms ±" in out
    found = SUMMARY.search(out)
    assert found and (int(found[1]), int(found[2])) == (len(pruned), len(verdicts))
    assert "by the SLO rule alone" in out and "no finished trial to dominate" in out
    minutes = SAVED.search(out)
    assert minutes and float(minutes[1].replace(",", "")) == pytest.approx(saved_s / 60, abs=0.05)


def test_a_point_the_ladder_stops_at_first_saves_its_first_level_only(tmp_path):
    space = load_space(_write(tmp_path, GPU_SPACE))
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path / "s", space.model, resolve_levels(space, workload))
    spec = context.spec_for({"max_num_seqs": 2})
    stops = preview_prune(spec, mean_lengths(workload), 0.0)
    climbs = preview_prune(replace(spec, stop_on_slo_break=False), mean_lengths(workload), 0.0)
    started = preview_prune(spec, mean_lengths(workload), 100.0)
    assert stops.record is not None and 0 < stops.device_s < climbs.device_s
    assert started.device_s == pytest.approx(stops.device_s + 100.0 * spec.devices)


def test_the_cpu_build_prunes_nothing_in_a_dry_run(tmp_path, capsys, no_ray, tiny_model):
    path = _write(
        tmp_path,
        f"name: cpu\nmodel: {tiny_model}\ndevice: cpu\nworkload: chat\nparams: {{max_num_seqs: [1, 4]}}\n"
        "slo: {ttft_ms: {p99: 1}}\nload: {kind: concurrency, levels: [1, 2]}\n"
        "search: {algorithm: grid, baseline: false, estimate: {prune: true}}\n",
    )
    out = dry_run(path, tmp_path, capsys)
    found = SUMMARY.search(out)
    assert found and found[1] == "0" and int(found[2]) == 2  # a 1 ms TTFT bound, and still nothing pruned
    assert "would be pruned:" not in out and "GPU-min saved" not in out
    assert "on the CPU build the estimate prunes only once the study has measured its own error" in out


def test_without_pruning_the_dry_run_says_nothing_of_it(tmp_path, capsys, no_ray):
    out = dry_run(_write(tmp_path, GPU_SPACE.replace("estimate: {prune: true}", "estimate: {prune: false}")),
                  tmp_path, capsys)  # fmt: skip
    assert "search.estimate.prune" not in out and "would be pruned" not in out


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path
