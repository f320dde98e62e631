"""The table of all trials as data: a row per trial, and configurations in few words."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.report import build_report, gather_points, load_study, render_markdown
from servetune.report.labels import TRIAL_HEADINGS, capacity_text, trial_cells
from servetune.report.params import BASELINE, short_config, varied_params
from servetune.report.recommend import Recommendation
from servetune.report.trials import trial_rows
from servetune.results import Capacity, best_level
from tests.builders import demo_study, demo_trials, level, study_info, trial, write_study

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


def test_a_configuration_in_few_words_names_only_what_the_study_varied():
    configs = [
        {},
        {"max_num_seqs": 32, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False, "block_size": 16},
        {"max_num_seqs": 8, "max_num_batched_tokens": 4096, "enable_chunked_prefill": True, "block_size": 16},
        {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True, "block_size": 16},
    ]
    varied = varied_params(configs)
    assert varied == ["max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"]  # block_size never varies
    assert short_config(configs[1], varied) == "seqs=32 mbt=4096 chunk=off"
    assert short_config(configs[0], varied) == BASELINE == "vLLM defaults"
    assert short_config({"env.VLLM_CPU_KVCACHE_SPACE": 2, "gpu_memory_utilization": 0.9}) == "kvGiB=2 gpu-mem=0.9"
    assert short_config({"some_new_arg": "x"}, varied) == "some_new_arg=x"  # set, though not varied: never blank
    assert (
        short_config({"speculative.method": "ngram", "speculative.num_speculative_tokens": 4}) == "spec=ngram spec-k=4"
    )
    assert varied_params([{"max_num_seqs": 8}]) == ["max_num_seqs"]  # one trial: nothing varies, show what it set


def test_a_row_per_trial_with_its_best_level_numbers_break_stop_and_conclusion():
    stopped = trial(
        "t8",
        {"max_num_seqs": 8, "gpu_memory_utilization": 0.9},
        [level(8, 100, 2500, violations=("ttft_ms_p99 = 2500 > 2000", "tpot_ms_p99 = 120 > 100"))],
    )
    stopped = stopped.model_copy(update={"stopped_because": "SLO broken at concurrency 8: ttft_ms_p99 = 2500 > 2000"})
    trials = [*demo_trials(), stopped]  # fmt: skip
    points = gather_points(trials)
    recommended = Recommendation(next(p for p in points if p.trial_id == "t16" and p.level_index == 1), "why")
    rows = {row.trial_id: row for row in trial_rows(trials, points, recommended)}
    assert [r.trial_id for r in trial_rows(trials, points, recommended)] == ["t16", "t32", "t8", "t256", "t64"]

    t16 = rows["t16"]
    assert t16.recommended and t16.config == "seqs=16 gpu-mem=0.9"
    assert t16.best_level == t16.numbers_level == "concurrency 16"  # the higher goodput under the SLO
    assert t16.values["ttft_ms_p99"] == 600 and t16.values["cost_per_mtok_usd"] == pytest.approx(2 / (700 * 3600) * 1e6)
    assert t16.slo_break is None and t16.stopped == "ran every level"

    t32 = rows["t32"]
    assert t32.best_level == "concurrency 32" and t32.slo_break.level == "concurrency 64"
    assert t32.slo_break.metrics == ("ttft_ms_p99",) and t32.conclusion.verdict == "keep"

    t8 = rows["t8"]  # no level met the SLO: the numbers are its last level's
    assert t8.best_level is None and t8.numbers_level == "concurrency 8" and t8.values["ttft_ms_p99"] == 2500
    assert t8.slo_break.metrics == ("ttft_ms_p99", "tpot_ms_p99")
    assert (t8.stopped, t8.stopped_detail) == ("SLO broken at concurrency 8", stopped.stopped_because)
    assert str(t8.conclusion) == "eliminate: broke the SLO at every load level"

    t64 = rows["t64"]
    assert t64.outcome == "FAILED" and t64.numbers_level is None and set(t64.values.values()) == {None}
    assert t64.stopped.startswith("engine exited with code 1: torch.OutOfMemoryError")
    assert len(t64.stopped) <= 80 and t64.conclusion.verdict == "eliminate"


def test_the_cells_say_the_bound_that_broke_and_where():
    report = build_report(load_study(RECORDED))
    cells = {row.trial_id: dict(zip(TRIAL_HEADINGS, trial_cells(row), strict=True)) for row in report.trial_table}
    base = cells["e57a166985b8"]
    assert base["trial"] == "e57a166985b8 (recommended)" and base["config (varied parameters)"] == "vLLM defaults"
    assert base["best level"] == "concurrency 8" and base["TTFT P99 (ms)"] == "88.7"
    assert base["SLO broken (first level)"] == "concurrency 32: ttft_ms_p95 = 160 > 150"
    assert base["conclusion"].startswith("keep: recommended to ship (the cheapest configuration meeting every SLO")
    cheap = cells["18ae6e731937"]
    assert cheap["config (varied parameters)"] == "seqs=32 mbt=4096 chunk=on prefix=on kvGiB=2 dp=1"
    assert cheap["best level"] == "none met the SLO (numbers at concurrency 2)"
    assert cheap["SLO broken (first level)"] == "concurrency 2: ttft_ms_p95 = 222.2 > 150; ttft_ms_p99 = 315.2 > 300"
    assert cheap["stopped because"] == "SLO broken at concurrency 2"
    assert cheap["conclusion"] == "eliminate: broke the SLO at every load level"
    assert len(cells) == 7 and [c["outcome"] for c in cells.values()] == ["COMPLETE"] * 7


def test_summary_md_has_the_table_of_all_trials(tmp_path):
    md = render_markdown(build_report(load_study(demo_study(tmp_path / "demo"))))
    section = md.split("### All trials")[1].split("\n#")[0]
    assert (
        "| trial | config (varied parameters) | outcome | best level | capacity at the SLO | knee | goodput (req/s) "
        "| TTFT P99 (ms) | TPOT P99 (ms) " in section
    )
    rows = [line for line in section.splitlines() if line.startswith("| t") and not line.startswith("| trial")]
    assert [r.split(" | ")[0] for r in rows] == ["| t16 (recommended)", "| t32", "| t256", "| t64"]
    assert "| t32 | seqs=32 gpu-mem=0.9 | COMPLETE | concurrency 32 | - |" in section  # no capacity search ran
    assert "concurrency 64: ttft_ms_p99 = 3000 > 2000 |" in section
    assert (
        "| t256 | seqs=256 gpu-mem=0.95 | INFEASIBLE | - | - | - | - | - | - | - | - | does not fit: KV pool" in section
    )


def test_levels_whose_prefix_cache_may_have_been_warm_are_listed(tmp_path):
    trials = demo_trials()
    warm = trials[1].levels[1].model_copy(update={"cache_note": "prefix-cache hit rate 60% is above the 0% ..."})
    trials[1] = trials[1].model_copy(update={"levels": [trials[1].levels[0], warm, trials[1].levels[2]]})
    rows = trial_rows(trials, gather_points(trials))
    assert {row.trial_id: row.cache_notes for row in rows}["t32"] == (
        "concurrency 32: prefix-cache hit rate 60% is above the 0% ...",
    )
    root = write_study(tmp_path / "warm", study_info(), trials)
    md = render_markdown(build_report(load_study(root)))
    assert "### Warm prefix cache\n\n- trial t32, concurrency 32: prefix-cache hit rate 60%" in md
    assert "### Warm prefix cache" not in render_markdown(build_report(load_study(demo_study(tmp_path / "cold"))))


def test_the_capacity_cell_says_what_the_search_found_and_how_sure_it_is():
    exact = Capacity(value=11, unit="concurrency", bracket=(11, 12), bound="exact", tolerance=0.1,
                     breaking_slo="ttft_ms_p95 <= 500", unsettled=[12])  # fmt: skip
    assert capacity_text(exact) == "11 clients (12 broke the SLO: ttft_ms_p95 <= 500), unsettled at 12"
    lower = Capacity(value=64, unit="concurrency", bracket=(64, None), bound="lower", tolerance=0.1)
    assert capacity_text(lower) == ">= 64 clients (none broke the SLO)"
    upper = Capacity(value=None, unit="req/s", bracket=(None, 0.5), bound="upper", tolerance=0.1)
    assert capacity_text(upper) == "< 0.5 req/s (none met the SLO)"
    assert capacity_text(None) == "-"


def test_a_trials_capacity_reaches_its_row(tmp_path):
    study = load_study(RECORDED)
    trial = next(t for t in study.trials if t.trial_id == "e57a166985b8")
    trial.capacity_at_slo = Capacity(value=20, unit="concurrency", bracket=(20, 24), bound="exact", tolerance=0.2,
                                     breaking_slo="ttft_ms_p95 <= 150")  # fmt: skip
    rows = {row.trial_id: row for row in build_report(study).trial_table}
    cells = dict(zip(TRIAL_HEADINGS, trial_cells(rows["e57a166985b8"]), strict=True))
    assert cells["capacity at the SLO"] == "20 clients (24 broke the SLO: ttft_ms_p95 <= 150)"
    assert {c for t, r in rows.items() if t != "e57a166985b8" for c in [trial_cells(r)[4]]} == {"-"}


def test_the_runs_closing_table_shows_each_trials_capacity_once_trials_searched_for_it():
    from rich.console import Console

    from servetune.space_file import load_space
    from servetune.study.progress import summary_table

    space = load_space(Path(__file__).parents[2] / "search_spaces" / "cpu-tiny.yaml")
    trials = demo_trials()
    for t in trials:
        t.best_level_index = best_level(t)  # as a trial records it

    def printed() -> str:
        console = Console(width=300, record=True)
        console.print(summary_table(trials, space))
        return console.export_text()

    assert "capacity at the SLO" not in printed()  # recorded before trials searched for their capacity
    trials[1].capacity_at_slo = Capacity(value=40, unit="concurrency", bracket=(40, 45), bound="exact",
                                         tolerance=0.15, breaking_slo="ttft_ms_p99 <= 2000")  # fmt: skip
    text = printed()
    assert "capacity at the SLO" in text and "40 clients (45 broke the SLO: ttft_ms_p99 <= 2000)" in text


def test_a_speculative_trials_acceptance_reaches_its_row_the_report_and_mlflows_fields(tmp_path):
    from servetune.engine.metrics import MetricsSnapshot, level_delta
    from servetune.report.html import hover_text
    from servetune.results import read_result
    from servetune.tracking.fields import level_metrics

    def counters(drafts: int, accepted: tuple[int, int]) -> MetricsSnapshot:
        per_pos = "".join(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {n}\n'
            for i, n in enumerate(accepted)
        )
        return MetricsSnapshot.parse(
            f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {2 * drafts}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {sum(accepted)}\n' + per_pos
        )

    server = level_delta(counters(0, (0, 0)), counters(40, (30, 12)))
    trials = demo_trials()
    spec = trial("tspec", {"speculative.method": "ngram"}, [level(16, 900, 500, server=server)])
    trials.append(spec)
    rows = {row.trial_id: row for row in trial_rows(trials, gather_points(trials))}
    assert rows["tspec"].speculation == (
        "accepted 52% of 80 drafted tokens, 2.05 tokens per step; by draft position 75% 30%"
    )
    assert rows["t16"].speculation is None  # no speculation: no line
    root = write_study(tmp_path / "spec", study_info(), trials)
    report = build_report(load_study(root))
    md = render_markdown(report)
    assert "### Speculative decoding\n\n- trial tspec (concurrency 16): accepted 52% of 80 drafted tokens" in md
    point = next(p for p in report.points if p.trial_id == "tspec")
    assert "speculation: accepted 52%" in hover_text(point)
    [logged] = level_metrics(read_result(root / "trials" / "tspec"))  # as result.json keeps it
    assert logged["spec_decode_acceptance_rate"] == pytest.approx(42 / 80)
    assert logged["spec_decode_mean_accepted_length"] == pytest.approx(1 + 42 / 40)
    assert logged["spec_decode_acceptance_rate_pos1"] == pytest.approx(12 / 40)
