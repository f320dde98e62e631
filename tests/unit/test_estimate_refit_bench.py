"""bench/estimate_refit.py: several prior weights compared on the same surfaces in one run."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.builders import bench_script

estimate_refit = bench_script("estimate_refit")


def _rows(monkeypatch, capsys, *priors: str) -> dict[str, str]:
    argv = ["estimate_refit.py", "--no-twin", "--orders", "2", "--bootstrap", "10", "--prior-points", *priors]
    monkeypatch.setattr(sys, "argv", argv)
    estimate_refit.main()
    rows = {}
    for line in capsys.readouterr().out.splitlines()[2:]:  # label, metric, then the numbers
        words = line.split()
        cut = next(i for i, w in enumerate(words) if w in estimate_refit.METRICS) + 1
        rows[" ".join(words[:cut])] = " ".join(words[cut:])
    return rows


def test_each_prior_weight_gets_its_own_rows_on_the_same_surfaces(monkeypatch, capsys):
    alone = _rows(monkeypatch, capsys, "5")
    both = _rows(monkeypatch, capsys, "5", "1")
    assert set(alone) == {f"{s} {m}" for s in ("cpu-tiny-grid", "cpu-tiny-grid-r3", "cpu-tiny-grid-r4")
                          for m in ("ttft_ms", "tpot_ms", "output_throughput")}  # fmt: skip
    # labelled by the prior where several are compared, and the default's rows are those of a run of it alone
    assert set(both) == {f"{k.split()[0]} p{w} {k.split()[1]}" for k in alone for w in (5, 1)}
    assert {k: both[f"{k.split()[0]} p5 {k.split()[1]}"] for k in alone} == alone
    # a weaker prior moves the refit further on the host the shipped factors miss: its error differs
    assert both["cpu-tiny-grid p1 ttft_ms"] != both["cpu-tiny-grid p5 ttft_ms"]


def test_the_share_of_the_reachable_improvement_counts_from_the_floor():
    share = estimate_refit.reachable_share
    assert share(0.40, 0.40, 0.10) == 0.0  # stayed at the shipped error
    assert share(0.40, 0.10, 0.10) == 1.0  # reached the floor
    assert share(0.40, 0.25, 0.10) == 0.5  # halved the error above the floor: the target, where 0.25 / 0.40 is 0.62
    assert share(0.40, 0.20, 0.0) == 0.5  # with a floor of 0 it is the halving, 1 - refit / shipped
    assert share(0.40, 0.05, 0.10) > 1 > 0 > share(0.40, 0.50, 0.10)  # past the floor; worse than shipped


def _orders(rng, n, shipped, refit, floor, spread=0.01):
    """n orders of 30 levels each: shipped, refit, floor errors around the given medians."""
    return [np.abs(np.array([shipped, refit, floor]) + rng.normal(0, spread, (30, 3))) for _ in range(n)]


def test_the_share_has_an_interval_over_orders_and_none_where_nothing_is_reachable():
    rng = np.random.default_rng(1)
    by_order = _orders(rng, 20, 0.35, 0.23, 0.12)
    medians, resampled = estimate_refit.bootstrap_medians(by_order, 200)
    assert resampled.shape == (200, 3)
    share, low, high = estimate_refit.judged_share(medians, resampled, 2)
    assert share == pytest.approx((0.35 - 0.23) / (0.35 - 0.12), abs=0.03)
    assert low < share < high and high - low < 0.1
    # one order whose refit went wrong widens the interval: orders are resampled whole
    worse = by_order[:19] + _orders(rng, 1, 0.35, 0.60, 0.12, spread=0.0)
    wide = estimate_refit.judged_share(*estimate_refit.bootstrap_medians(worse, 200), 2)
    assert wide[2] - wide[1] > high - low
    # a floor as high as the shipped error leaves nothing to share (shipped twin, the fit's own surface)
    flat = estimate_refit.bootstrap_medians(_orders(rng, 20, 0.10, 0.11, 0.10), 200)
    assert estimate_refit.judged_share(*flat, 2) is None


def test_each_row_gives_the_refit_on_the_whole_surface_as_a_floor(monkeypatch, capsys):
    rows = _rows(monkeypatch, capsys, "5")
    # the Intel host, where the shipped factors miss by far: the whole surface's refit is a floor well below shipped
    words = rows["cpu-tiny-grid tpot_ms"].replace("[", "").replace("]", "").replace(",", "").split()
    shipped, best, share = float(words[0].rstrip("%")), float(words[-4].rstrip("%")), float(words[-3])
    assert best < shipped / 2 and 0 < share <= 1.2
