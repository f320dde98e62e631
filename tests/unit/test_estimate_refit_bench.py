"""bench/estimate_refit.py: several prior weights compared on the same surfaces in one run."""

from __future__ import annotations

import sys

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
