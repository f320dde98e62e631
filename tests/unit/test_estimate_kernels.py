"""The kernel CSV of calibration/gpu_kernels.py joined to the estimate's per-GPU-class factors (estimate/kernels.py,
``servetune estimate --kernels``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from servetune import cli
from servetune.errors import UserError
from servetune.estimate import load_factors
from servetune.estimate.kernels import gpu_kernel_factors

REPO = Path(__file__).resolve().parents[2]
SPACE = REPO / "search_spaces" / "offline-batch.yaml"  # Llama-3.1-8B on H100-SXM

# An H100-SXM in the catalogue: 989 bf16 TFLOP/s, 3,350 GB/s of HBM. The synthetic GPU below reaches these.
BANDWIDTH_GBPS = 0.8 * 3350  # what its memory-bound kernels read and write
PEAK_TFLOPS = 0.7 * 989  # what its compute-bound kernels multiply
COPY_GBPS = 0.9 * 3350


def kernel_rows(bandwidth_gbps: float = BANDWIDTH_GBPS, tflops: float = PEAK_TFLOPS) -> list[dict[str, float | str]]:
    """The rows gpu_kernels.py writes, with its shapes, its FLOP and byte counts and its units (ms, TFLOP/s, GB/s),
    timed by a roofline at ``bandwidth_gbps`` and ``tflops``: each case takes the longer of its bytes and FLOPs."""

    def row(kind: str, m: int, n: int, k: int, flops: float, bytes_: float) -> dict[str, float | str]:
        ms = max(bytes_ / (bandwidth_gbps * 1e9), flops / (tflops * 1e12)) * 1e3
        return {"kind": kind, "m": m, "n": n, "k": k, "ms": ms, "tflops": flops / ms / 1e9, "gbps": bytes_ / ms / 1e6}

    numel = 2 * 1024**3
    copy_ms = 2 * numel * 2 / (COPY_GBPS * 1e9) * 1e3
    rows = [{"kind": "copy", "m": 0, "n": 0, "k": 0, "ms": copy_ms, "tflops": 0, "gbps": 2 * numel * 2 / copy_ms / 1e6}]
    H, FFN, NH, KVH, HD, V = 4096, 14336, 32, 8, 128, 128256
    shapes = {"qkv": (H, (NH + 2 * KVH) * HD), "o": (NH * HD, H), "gate_up": (H, 2 * FFN), "down": (FFN, H),
              "lm_head": (H, V)}  # fmt: skip
    for name, (k, n) in shapes.items():
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
            rows.append(row("linear_" + name, m, n, k, 2 * m * n * k, (m * k + n * k + m * n) * 2))
    for b in (1, 8, 32, 128):
        for L in (512, 2048, 8192, 32768):
            if b * L > 128 * 8192:
                continue
            rows.append(row("attn_decode", b, L, HD, 4 * b * NH * L * HD, 2 * b * KVH * L * HD * 2))
    for S in (512, 2048, 8192, 16384):
        r = row("attn_prefill_causal", 1, S, HD, 4 * NH * S * S * HD / 2, 0)
        r["gbps"] = 0
        rows.append(r)
    return rows


def write_csv(path: Path, rows: list[dict[str, float | str]]) -> Path:
    with open(path, "w", newline="") as f:  # as gpu_kernels.py writes it
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    return path


def test_the_kernels_give_the_bandwidth_and_flops_fractions_of_the_catalogue_peaks(tmp_path):
    kernels = gpu_kernel_factors(write_csv(tmp_path / "k.csv", kernel_rows()), "H100-SXM")
    assert kernels.gpu == "H100-SXM" and kernels.gpu_class == "H100"
    assert kernels.decode_bandwidth == pytest.approx(0.8, abs=1e-3)
    assert kernels.prefill_flops == pytest.approx(0.7, abs=1e-3)
    assert kernels.hbm_copy == pytest.approx(0.9, abs=1e-3)
    # H100-SXM's ridge is 989 / 3.35 = 295 FLOPs a byte. Decode's rows: the 15 attn_decode cases and the linear
    # layers at 1 to 128 tokens (5 shapes x 8 sizes, at most 128 FLOPs a byte); prefill's: the 4 causal attentions
    # and the linear layers from 1,024 tokens up (5 x 4); 256 and 512 tokens sit near the ridge, in neither
    assert (kernels.decode_rows, kernels.prefill_rows) == (15 + 5 * 8, 4 + 5 * 4)


def test_rows_are_pooled_by_their_time_as_a_step_adds_its_kernels(tmp_path):
    """Attention reading its KV at half the weights' bandwidth: decode's fraction is all bytes over all time."""
    rows = kernel_rows()
    slow = kernel_rows(bandwidth_gbps=BANDWIDTH_GBPS / 2)
    rows = [s if r["kind"] == "attn_decode" else r for r, s in zip(rows, slow, strict=True)]
    memory = [r for r in rows if r["kind"] == "attn_decode" or (str(r["kind"]).startswith("linear") and r["m"] <= 128)]
    seconds = sum(float(r["ms"]) / 1e3 for r in memory)
    pooled = sum(float(r["gbps"]) * 1e9 * float(r["ms"]) / 1e3 for r in memory) / seconds
    assert 0.45 < pooled / 3350e9 < 0.75  # between the two, weighted by time (not the rows' mean, nor either rate)
    kernels = gpu_kernel_factors(write_csv(tmp_path / "k.csv", rows), "H100-SXM")
    assert kernels.decode_bandwidth == pytest.approx(pooled / 3350e9, abs=1e-4)


def test_the_fractions_follow_the_gpu_and_the_same_timings_on_a_faster_gpu_are_smaller(tmp_path):
    path = write_csv(tmp_path / "k.csv", kernel_rows(bandwidth_gbps=0.8 * 3350, tflops=0.7 * 989))
    h200 = gpu_kernel_factors(path, "H200")  # the same FLOP/s peak, 4,800 GB/s of HBM
    assert h200.gpu_class == "H200"
    assert h200.decode_bandwidth == pytest.approx(0.8 * 3350 / 4800, abs=1e-3)
    assert h200.prefill_flops == pytest.approx(0.7, abs=1e-3)


def test_the_kernels_replace_their_classs_bandwidth_and_flops_and_keep_its_overheads(tmp_path):
    kernels = gpu_kernel_factors(write_csv(tmp_path / "k.csv", kernel_rows()), "H100-SXM")
    shipped = load_factors().for_class("H100")
    eff = kernels.efficiency(shipped)
    assert (eff.decode_bandwidth, eff.prefill_flops) == (kernels.decode_bandwidth, kernels.prefill_flops)
    assert eff.step_overhead_ms == shipped.step_overhead_ms and eff.allreduce_us == shipped.allreduce_us


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: [{k: v for k, v in r.items() if k != "gbps"} for r in rows], "k.csv: column gbps missing"),
        (lambda rows: [{**r, "ms": "fast"} for r in rows], "k.csv line 2: column ms: 'fast' is not"),
        (lambda rows: [{**r, "ms": 0} for r in rows], "k.csv line 2: column ms: '0' is not"),
        (lambda rows: [{**r, "tflops": -1} for r in rows], "k.csv line 2: column tflops: '-1' is not"),
        (
            lambda rows: [r for r in rows if r["kind"] != "attn_prefill_causal" and r["m"] < 256],
            "k.csv: column kind: no",
        ),
        (
            lambda rows: [{**r, "gbps": float(r["gbps"]) / 1e3} for r in rows],
            "k.csv: column gbps: its rows reach 0.09%",
        ),
        (lambda rows: [{**r, "gbps": float(r["gbps"]) * 2} for r in rows], "k.csv: column gbps: its rows reach 1.80 x"),
        (
            lambda rows: [{**r, "tflops": float(r["tflops"]) * 2} for r in rows],
            "k.csv: column tflops: its rows reach 1.40 x",
        ),
    ],
)
def test_a_bad_kernel_csv_is_one_error_naming_the_file_and_column(tmp_path, edit, message):
    path = write_csv(tmp_path / "k.csv", edit(kernel_rows()))
    with pytest.raises(UserError, match="^" + str(tmp_path).replace("\\", "\\\\") + "/" + message.replace(".", r"\.")):
        gpu_kernel_factors(path, "H100-SXM")


def _estimate(capsys, *extra: str) -> tuple[int, dict, str]:
    rc = cli.main(["estimate", str(SPACE), "--json", *extra])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else {}), err


def test_estimate_with_kernels_estimates_its_gpu_class_with_their_fractions(tmp_path, capsys):
    path = write_csv(tmp_path / "k.csv", kernel_rows(bandwidth_gbps=0.95 * 3350, tflops=0.9 * 989))
    rc, base, _ = _estimate(capsys)
    assert rc == 0
    rc, fast, _ = _estimate(capsys, "--kernels", str(path))
    assert rc == 0
    assert fast["kernels"]["gpu"] == "H100-SXM"
    assert fast["kernels"]["decode_bandwidth"] == pytest.approx(0.95, abs=1e-3)
    assert fast["kernels"]["shipped"]["decode_bandwidth"] == load_factors().for_class("H100").decode_bandwidth
    # fractions above the shipped ones (0.69, 0.49): every row's decode step, so its TPOT, is shorter
    pairs = [(b["estimate"], f["estimate"]) for b, f in zip(base["rows"], fast["rows"], strict=True) if "estimate" in b]
    assert pairs and all(f["tpot_ms"] < b["tpot_ms"] for b, f in pairs)
    assert "kernels" not in base


def test_estimate_prints_what_the_kernels_reached(tmp_path, capsys):
    path = write_csv(tmp_path / "k.csv", kernel_rows())
    assert cli.main(["estimate", str(SPACE), "--kernels", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kernels: H100 GPUs' rows use the fractions" in out
    assert "decode 80% of its HBM bandwidth" in out and "prefill 70% of its bf16 peak" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kernels-gpu", "H200"], "--kernels-gpu H200: give the --kernels CSV"),
        (["--kernels", "KCSV", "--kernels-gpu", "H200"], "--kernels-gpu H200: no GPU type of"),
        (["--kernels", "KCSV", "--kernels-gpu", "Z9000"], "--kernels-gpu Z9000: not a catalogue GPU"),
        (["--kernels", "missing.csv"], "missing.csv: cannot read the kernel CSV"),
    ],
)
def test_estimate_kernels_bad_input_is_one_line(tmp_path, capsys, extra, message):
    path = write_csv(tmp_path / "k.csv", kernel_rows())
    rc, _, err = _estimate(capsys, *[str(path) if a == "KCSV" else a for a in extra])
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1
