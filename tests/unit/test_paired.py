"""The paired comparison's judgement (verify/stats.py ``paired_difference``, verify/paired.py ``judge``): a host that
drifts between rounds slows both sides of a round, and that cancels; a real difference survives it; a difference
inside the rounds' own spread is a tie. And ``recheck --paired``'s bad input, one line before anything starts."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from servetune.cli import main
from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT, TTFT_P99
from servetune.verify.paired import PAIRED_EXIT_STATUS, Paired, PairedRound, judge
from servetune.verify.stats import mean_interval, paired_difference, paired_noise

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"

#: A shared host's goodput of one configuration over three rounds minutes apart: 10.4 then 22.4 req/s, as the
#: speculative-decoding study measured its baseline in two runs ten minutes apart, and a round between.
DRIFT = [10.4, 22.4, 15.0]


def test_drift_that_slows_both_sides_of_a_round_cancels():
    a = DRIFT
    b = [1.15 * x for x in a]  # B carries 15% more, whatever the host did that round
    diff = paired_difference(a, b)
    assert diff is not None and diff.verdict == "B better" and diff.b_ahead == 3
    assert diff.ratio == pytest.approx(1.15)
    assert diff.low == pytest.approx(diff.high) == pytest.approx(diff.change)  # every round says the same
    # unpaired, the drift would swamp it: A's own rounds spread far wider than the 15% between them
    assert (max(a) - min(a)) / min(a) > 1.0


def test_a_real_difference_survives_drift_and_jitter():
    jitter_a, jitter_b = [1.02, 0.97, 1.01, 0.99, 1.03], [0.98, 1.02, 1.0, 1.03, 0.97]
    drift = [10.4, 22.4, 15.0, 12.0, 19.0]
    a = [d * j for d, j in zip(drift, jitter_a, strict=True)]
    b = [0.8 * d * j for d, j in zip(drift, jitter_b, strict=True)]
    diff = paired_difference(a, b)
    assert diff is not None and diff.verdict == "A better" and diff.b_ahead == 0
    assert diff.high is not None and diff.high < 0 and abs(diff.change) > diff.noise


def test_a_difference_inside_the_rounds_spread_is_a_tie():
    drift = [10.4, 22.4, 15.0]
    b = [d * j for d, j in zip(drift, [1.06, 0.95, 1.02], strict=True)]
    diff = paired_difference(drift, b)
    assert diff is not None and diff.verdict == "tie" and 0 < diff.b_ahead < 3


def test_a_consistent_difference_below_the_floor_is_a_tie():
    diff = paired_difference(DRIFT, [1.02 * x for x in DRIFT], floor=0.05)
    assert diff is not None and diff.verdict == "tie" and diff.noise == 0.05
    assert paired_difference(DRIFT, [1.02 * x for x in DRIFT], floor=0.01).verdict == "B better"


def test_for_a_latency_lower_is_better():
    a = [300.0, 600.0, 420.0]  # P99 TTFT, ms, drifting with the host
    diff = paired_difference(a, [0.7 * x for x in a], higher_is_better=False)
    assert diff is not None and diff.verdict == "B better" and diff.change < 0 and diff.b_ahead == 3


def test_a_side_that_carried_nothing_loses_every_round_and_too_few_rounds_are_not_judged():
    diff = paired_difference([0.0, 0.0, 0.0], [3.0, 5.0, 4.0])
    assert diff is not None and diff.verdict == "B better" and diff.change == 2.0 and diff.ratio is None
    assert paired_difference([0.0, 0.0], [0.0, 0.0]) is None  # both nothing: no round to judge
    assert paired_difference([5.0], [6.0]) is None


def sides(diffs, host=None):
    """A and B of rounds whose paired differences (B - A) / mean(A, B) are ``diffs``, each round's both sides scaled
    by the host's speed that round (``host``; 1 when None)."""
    host = [1.0] * len(diffs) if host is None else host
    return ([h * (1 - d / 2) for h, d in zip(host, diffs, strict=True)],
            [h * (1 + d / 2) for h, d in zip(host, diffs, strict=True)])  # fmt: skip


def draws(seed: int, rounds: int, true: float = 0.0, sigma: float = 0.15) -> list[float]:
    return list(np.random.default_rng(seed).normal(true, sigma, rounds))


def test_the_paired_noise_does_not_grow_with_the_rounds():
    # the same distribution of rounds (15% per round) measured 6 and 12 times, 100 times over
    six = np.median([paired_noise(draws(seed, 6)) for seed in range(100)])
    twelve = np.median([paired_noise(draws(seed, 12)) for seed in range(100, 200)])
    assert abs(twelve / six - 1) < 0.15, (six, twelve)
    assert 0.5 * 0.15 < six < 0.9 * 0.15  # the probable error of one round: 0.67 of its standard deviation
    # half the full spread, the old paired noise, followed the extremes out
    spread = [np.median([np.ptp(draws(seed, n)) / 2 for seed in range(100)]) for n in (6, 12)]
    assert spread[1] / spread[0] > 1.15 and min(spread) > 0.15
    # one wild round moves it little; the floor still holds
    calm = draws(7, 12)
    assert paired_noise([*calm[:-1], 3.0]) < 1.5 * paired_noise(calm)
    assert paired_difference(*sides([0.01, 0.012, 0.011, 0.01]), floor=0.05).noise == 0.05


def test_more_rounds_settle_a_real_difference_that_three_cannot():
    # B carries 20% more than A; one round's difference strays 15% (sigma); 100 studies of each length
    def settled(rounds: int) -> float:
        verdicts = [paired_difference(*sides(draws(seed, rounds, true=0.2))).verdict for seed in range(100)]
        assert "A better" not in verdicts
        return verdicts.count("B better") / len(verdicts)

    three, eight = settled(3), settled(8)
    assert eight >= 0.75 and three <= 0.4, (three, eight)
    # no difference at all is called a difference rarely, at either length
    for rounds in (3, 8):
        verdicts = [paired_difference(*sides(draws(seed, rounds))).verdict for seed in range(100)]
        assert verdicts.count("tie") >= 88, rounds


def test_three_rounds_on_one_side_are_not_a_95_percent_interval():
    # the rounds' range is a bootstrap's 95% interval of three; Student's t reaches beyond it
    diffs = [0.05, 0.2, 0.35]
    interval = mean_interval(diffs)
    assert interval is not None and interval.low < 0 < interval.high
    assert paired_difference(*sides(diffs)).verdict == "tie"
    # with many rounds the interval is the bootstrap's, close around the mean
    many = draws(3, 40, true=0.2)
    wide = mean_interval(many)
    assert wide is not None and 0 < wide.low < wide.mean < wide.high


def test_a_drift_common_to_both_sides_still_cancels_with_more_rounds():
    diffs = draws(11, 8, true=0.2)
    host = list(np.random.default_rng(12).uniform(0.4, 2.2, 8))  # the host's speed each round, as much as 10.4 -> 22.4
    steady, drifting = paired_difference(*sides(diffs)), paired_difference(*sides(diffs, host))
    assert drifting.verdict == steady.verdict == "B better"
    assert drifting.noise == pytest.approx(steady.noise) and drifting.change == pytest.approx(steady.change)
    a, _ = sides(diffs, host)
    assert paired_noise([x / np.median(a) - 1 for x in a]) > 3 * steady.noise  # unpaired, the drift swamps it


def rounds(a: list[float], b: list[float], key: str = GOODPUT, ttft: tuple[float, float] = (100.0, 100.0)):
    return [PairedRound(round=i, first="A" if i % 2 == 0 else "B", a={key: x, OUTPUT_THROUGHPUT: 10 * x + 1,
                        TTFT_P99: ttft[0]}, b={key: y, OUTPUT_THROUGHPUT: 10 * y + 1, TTFT_P99: ttft[1]},
                        a_meets_slo=x > 0, b_meets_slo=y > 0)
            for i, (x, y) in enumerate(zip(a, b, strict=True))]  # fmt: skip


def test_the_verdict_is_taken_on_goodput_with_every_metric_beside_it():
    metrics, decided, verdict, reason = judge(rounds(DRIFT, [0.8 * x for x in DRIFT], ttft=(100.0, 130.0)))
    assert decided == GOODPUT and verdict == "A better"
    by_name = {m.metric: m for m in metrics}
    assert by_name[TTFT_P99].verdict == "A better" and by_name[TTFT_P99].change > 0  # B's latency higher: worse
    assert f"B ahead in 0 of {len(DRIFT)}" in reason and "goodput: A 15, B 12" in reason, reason
    doc = Paired(study="s", vllm="v", a_trial_id="a", b_trial_id="b", level={"concurrency": 8.0}, mode="side by side",
                 rounds_asked=3, rounds=rounds(DRIFT, DRIFT), metrics=metrics, decided_on=decided, verdict=verdict,
                 reason=reason)  # fmt: skip
    assert doc.exit_status == 0


def test_where_neither_met_the_slo_it_is_taken_on_output_throughput():
    _, decided, verdict, reason = judge(rounds([0.0] * 3, [0.0] * 3))
    assert decided == OUTPUT_THROUGHPUT and verdict == "tie within the paired noise"
    assert "goodput 0 on both sides" in reason
    assert PAIRED_EXIT_STATUS[verdict] == 5 and PAIRED_EXIT_STATUS["B better"] == 1


@pytest.mark.parametrize(("argv", "words"), [
    (["--rounds", "3"], ["--rounds goes with --paired"]),
    (["--against", "runner-up"], ["--against goes with --paired"]),
    (["--paired", "--rounds", "1"], ["--rounds must be at least 2"]),
    (["--paired", "--runner-up"], ["--against runner-up"]),
    (["--paired", "--repeats", "3"], ["--repeats goes without --paired"]),
])  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, words):
    status = main(["recheck", str(tmp_path / "nowhere"), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and err[0].startswith("servetune recheck: error:"), err
    assert all(word in err[0] for word in words), err


@pytest.mark.parametrize(("against", "words"), [
    (WINNER, ["--against", "the one picked"]),
    ("nosuchtrial", ["a trial id of this study"]),
])  # fmt: skip
def test_the_other_configuration_must_be_another_trial_of_the_study(tmp_path, capsys, against, words):
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    status = main(["recheck", str(study), "--paired", "--against", against])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and all(word in err[0] for word in words), err
    assert not (study / "recheck").exists()
