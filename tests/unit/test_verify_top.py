"""``search.verify: {top: K}``: the space's field, which K points, when a stored verification is kept,
and what the report makes of several verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from servetune.errors import UserError
from servetune.report import ReportPoint, TrialOutline, recommend
from servetune.report.points import is_out_of_memory
from servetune.report.verification import VerifyFile, conclusion, primary, verifications
from servetune.study.verify_top import kept_document
from servetune.verify.choose import top_points
from tests.builders import space_from

#: What this module's spaces have beneath builders.SPACE_HEAD.
BASE = """\
hardware: {devices_per_node: 2}
"""


def space(tmp_path, search: str):
    return space_from(tmp_path, BASE + f"search: {search}\n")


def test_verify_top_in_the_search_section(tmp_path):
    s = space(tmp_path, "{algorithm: tpe, verify: {top: 2, duration_s: 120}}")
    assert (s.search.verify.top, s.search.verify.duration_s) == (2, 120)
    s = space(tmp_path, "{verify: {top: 1}}")
    assert s.search.verify.duration_s is None  # verify's own default for the device
    assert space(tmp_path, "{algorithm: grid}").search.verify is None


@pytest.mark.parametrize("search, needle", [
    ("{verify: {top: 0}}", "search.verify.top: Input should be greater than or equal to 1"),
    ("{verify: {top: -1}}", "search.verify.top"),
    ("{verify: {top: 2, durations: 5}}", "search.verify.durations: unknown key"),
    ("{verify: {duration_s: 60}}", "search.verify.top: Field required"),
    ("{verify: {top: 1, duration_s: 0}}", "search.verify.duration_s"),
    ("{verify: {top: two}}", "search.verify.top"),
])  # fmt: skip
def test_bad_verify_is_one_line_naming_file_and_field(tmp_path, search, needle):
    with pytest.raises(UserError) as info:
        space(tmp_path, search)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")) and needle in message and "\n" not in message, message


def pt(trial_id: str, cost: float, params: dict | None = None, level_index: int = 0, **kwargs) -> ReportPoint:
    return ReportPoint(trial_id=trial_id, level_index=level_index, level={"concurrency": 2.0 * (level_index + 1)},
                       params=params or {"max_num_seqs": len(trial_id)}, metrics={"cost_per_mtok_usd": cost, "ttft_ms_p99": 100.0},
                       **kwargs)  # fmt: skip


def report_of(points: list[ReportPoint], trials: list[TrialOutline]):
    return SimpleNamespace(recommendation=recommend(points, trials), points=points)


def test_top_points_are_the_recommendation_then_other_trials_cheapest_first_one_point_each():
    points = [
        pt("b", 2.0),
        pt("a", 1.0),
        pt("a", 0.9, level_index=1),
        pt("c", 3.0),
        pt("d", 0.1, slo_violations=("ttft_ms_p99 = 9 > 2",)),
    ]
    report = report_of(points, [TrialOutline(t, points[0].params, "COMPLETE") for t in "abcd"])
    assert [(p.trial_id, p.level_index) for p in top_points(report, 2)] == [("a", 1), ("b", 0)]
    assert [p.trial_id for p in top_points(report, 1)] == ["a"]
    assert [p.trial_id for p in top_points(report, 10)] == ["a", "b", "c"]  # d never met the SLO: fewer than asked


def test_a_stepped_back_recommendation_comes_first_and_the_point_passed_over_follows():
    cheap, safe = {"max_num_seqs": 32, "block_size": 16}, {"max_num_seqs": 16, "block_size": 16}
    points = [pt("s16", 1.5, safe), pt("s32", 1.0, cheap)]
    reason = "CUDA out of memory"
    trials = [TrialOutline("s16", safe, "COMPLETE"), TrialOutline("s32", cheap, "COMPLETE"),
              TrialOutline("s64", {"max_num_seqs": 64, "block_size": 16}, "FAILED", reason, out_of_memory=is_out_of_memory(reason))]  # fmt: skip
    report = report_of(points, trials)
    assert report.recommendation.point.trial_id == "s16"
    assert [p.trial_id for p in top_points(report, 2)] == ["s16", "s32"]


def test_no_recommendation_nothing_to_verify():
    points = [pt("a", 1.0, slo_violations=("ttft_ms_p99 = 9 > 2",))]
    assert top_points(report_of(points, [TrialOutline("a", points[0].params, "COMPLETE")]), 3) == []


SETTINGS = {
    "trial_id": "a",
    "level": {"concurrency": 2.0},
    "params": {"max_num_seqs": 8},
    "budget": {"soak_s": 60.0},
    "rank": 0,
}


@pytest.mark.parametrize("stored, kept", [
    ({**SETTINGS}, True),
    ({**SETTINGS, "rank": 1}, True),  # the same verification, now the second point: still the same one
    ({**SETTINGS, "budget": {"soak_s": 120.0}}, False),  # another duration_s
    ({**SETTINGS, "level": {"concurrency": 8.0}}, False),
    ({**SETTINGS, "params": {"max_num_seqs": 16}}, False),
    (None, False),  # verify.json of `servetune verify`: no settings
])  # fmt: skip
def test_a_stored_verification_is_kept_only_for_the_same_trial_level_parameters_and_budget(tmp_path, stored, kept):
    path = tmp_path / "a.json"
    doc = {"trial_id": "a", "accepted": False, "reasons": ["engine: engine start: vLLM exited"]}
    if stored is not None:
        doc["settings"] = stored
    path.write_text(json.dumps(doc))
    assert (kept_document(path, SETTINGS) is not None) == kept
    path.write_text('{"trial_id": "a", "settings": ')  # half-written: run it again
    assert kept_document(path, SETTINGS) is None
    assert kept_document(tmp_path / "missing.json", SETTINGS) is None


def verified(study: Path, trial: str, rank: int | None, accepted: bool) -> VerifyFile:
    content = {"trial_id": trial, "level": {"concurrency": 2}, "accepted": accepted,
               "reasons": ["every scenario passed"] if accepted else ["soak: P99 TTFT jitter 3.1 > 2"]}  # fmt: skip
    if rank is not None:
        content["settings"] = {"rank": rank}
    return VerifyFile(study / ("verify.json" if rank is None else f"verify/{trial}.json"), content)


@pytest.mark.parametrize("verdicts, said", [
    ((True, False), "The recommendation (trial a) passed verification: ship it."),
    ((False, True), "The recommendation (trial a) was rejected by verification; trial b, verified next, was accepted: "
                    "ship it instead (servetune export S --pick b)."),
    ((False, False), "Every verified point was rejected (2): none is ready to ship as measured."),
])  # fmt: skip
def test_the_verdicts_together_decide_what_to_ship(verdicts, said):
    study = Path("S")
    files = [verified(study, "b", 1, verdicts[1]), verified(study, "a", 0, verdicts[0])]
    listed = verifications(study, None, files)
    assert [v.trial_id for v in listed] == ["a", "b"]  # verify order, not file order
    assert listed[1].reason == ("every scenario passed" if verdicts[1] else "soak: P99 TTFT jitter 3.1 > 2")
    assert conclusion(listed, "a", study) == said
    assert primary(listed, "a", study).trial_id == "a"


def test_one_verification_needs_no_conclusion_and_verify_json_stays_the_recommendations_verdict():
    study = Path("S")
    only = verifications(study, verified(study, "a", None, True), [])
    assert conclusion(only, "a", study) == "" and primary(only, "a", study).path == study / "verify.json"
    both = verifications(study, verified(study, "a", None, False), [verified(study, "a", 0, True)])
    assert primary(both, "a", study).rank is None  # servetune verify's own verify.json stays the verdict stated first
    assert not primary((), "a", study).found


def test_a_point_no_longer_in_the_top_has_its_verification_set_aside_not_reported(tmp_path):
    from servetune.report.verification import read_verify_files
    from servetune.study.verify_top import set_aside_superseded

    here = tmp_path / "verify"
    for trial_id, rank in (("aaa", 0), ("bbb", 1), ("ccc", 2)):
        (here / trial_id).mkdir(parents=True)
        (here / trial_id / "engine.log").write_text(f"{trial_id} log")
        (here / f"{trial_id}.json").write_text(
            json.dumps({"trial_id": trial_id, "accepted": True, "settings": {"rank": rank}})
        )
    said: list[str] = []
    set_aside_superseded(tmp_path, {"bbb", "ddd"}, said.append)  # a resumed study: bbb still in, aaa and ccc out
    assert sorted(p.name for p in here.iterdir()) == ["bbb", "bbb.json", "superseded"]
    aside = here / "superseded"
    assert sorted(p.name for p in aside.iterdir()) == ["aaa", "aaa.json", "ccc", "ccc.json"]
    assert (aside / "aaa" / "engine.log").read_text() == "aaa log"  # kept, with its log
    assert said == [
        f"verify: trials aaa, ccc are no longer among the points to verify: their verification moved to {aside}"
    ]
    assert [f.path.stem for f in read_verify_files(tmp_path)] == ["bbb"]  # the report shows the current top only
    # Set aside again later (verified anew, then dropped again): the newer one replaces the older.
    (here / "bbb.json").replace(here / "aaa.json")
    set_aside_superseded(tmp_path, set(), said.append)
    assert json.loads((aside / "aaa.json").read_text())["trial_id"] == "bbb"
    assert said[-1] == f"verify: trial aaa is no longer among the points to verify: its verification moved to {aside}"
    said.clear()
    set_aside_superseded(tmp_path, set(), said.append)
    assert said == []  # nothing left to set aside: nothing said
