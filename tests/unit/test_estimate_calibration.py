"""The calibration reads the public data set, splits it deterministically and fits factors that help."""

from __future__ import annotations

import hashlib

from servetune.estimate import Efficiency, load_factors
from servetune.estimate import calibrate as cal


def _text() -> str:
    return cal.shipped_data()


def test_the_shipped_factors_were_fitted_on_the_shipped_data():
    factors = load_factors()
    assert factors.data_sha256 == hashlib.sha256(_text().encode("utf-8")).hexdigest()
    assert factors.fit_date and factors.split
    assert {"A100", "H100"} <= set(factors.per_gpu_class)
    assert set(factors.held_out_error) == set(cal.METRICS)


def test_rows_become_points_and_the_split_is_deterministic():
    points, skipped = cal.read_points(_text())
    again, _ = cal.read_points(_text())
    assert [p.held_out for p in points] == [p.held_out for p in again]
    held = sum(p.held_out for p in points)
    assert 0.1 * len(points) < held < 0.3 * len(points)
    assert len(points) + sum(skipped.values()) == _text().count("\n") - 1 - _multiline_rows(_text())
    assert {p.regime for p in points} >= {"offline", "closed", "open", "prefill"}
    assert {p.gpu_class for p in points} == {"A100", "H100", "H200"}


def _multiline_rows(text: str) -> int:
    import csv
    import io

    rows = list(csv.reader(io.StringIO(text)))
    return text.count("\n") - len(rows)


def test_fitting_lowers_the_held_out_error_below_the_starting_factors():
    points, _ = cal.read_points(_text())
    train = [p for p in points if not p.held_out and p.gpu_class == "A100"]
    held = [p for p in points if p.held_out and p.gpu_class == "A100"]
    start = Efficiency()
    fitted = cal.fit_efficiency(train, start=start)
    assert fitted != start

    def median_error(eff: Efficiency) -> float:
        for p in held:
            p.predicted, p.saturated = cal.predict(p, eff)
        err = cal.error_of(held, "output_throughput")
        assert err is not None
        return err.median

    assert median_error(fitted) < median_error(start)


def test_an_unknown_model_row_is_counted_not_fatal():
    header = _text().splitlines()[0]
    row = 'x,u,h100_sxm,acme/Unknown-1B,bf16,none,1,0.9,128,128,1,offline,,,,,100,""'
    points, skipped = cal.read_points(header + "\n" + row + "\n")
    assert points == [] and skipped["model or GPU not described"] == 1


def test_a_row_faster_than_the_gpu_allows_is_left_out():
    header = _text().splitlines()[0]
    # Llama-3.1-8B on one H100 at batch 64 and 4k context cannot decode a token every 1 ms:
    # its weights alone take ~5 ms to read at full bandwidth.
    fast = 'x,u,h100_sxm,meta-llama/Llama-3.1-8B-Instruct,bf16,none,1,0.9,4000,1000,64,inf,,,1.0,,,""'
    slow = 'x,u,h100_sxm,meta-llama/Llama-3.1-8B-Instruct,bf16,none,1,0.9,4000,1000,64,inf,,,40.0,,,""'
    points, skipped = cal.read_points(header + "\n" + fast + "\n" + slow + "\n")
    assert skipped["faster than the GPU's peaks allow"] == 1
    assert [p.measured["tpot_ms"] for p in points] == [40.0]
