"""The fake engine's GPU twin (testing/twin.py): its pace from the estimate, and the fake serving at it."""

from __future__ import annotations

import itertools
import json
import math
import re
import time

import httpx
import pytest

from servetune.errors import UserError
from servetune.estimate import load_factors
from servetune.testing.fake_openai import FakeOpenAI, main
from servetune.testing.twin import (
    NOISE_CLIP_SIGMAS,
    RUN_SPREAD_SIGMA,
    Twin,
    TwinConfig,
    engine_args_from_argv,
    noise_factor,
    twin_from_env,
)
from tests.conftest import serve_fake

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def twin(spread: float = 0.0, **engine_args) -> Twin:
    args = {"max_num_seqs": 16, "max_model_len": 8192, **engine_args}
    return Twin(TwinConfig(gpu="H100-SXM", model=LLAMA_8B, engine_args=args, spread=spread))


def test_itl_grows_with_the_batch_and_stops_at_max_num_seqs() -> None:
    t = twin()
    itl = [t.pace(n, 600, 200).itl_s for n in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in itertools.pairwise(itl))
    # Past max_num_seqs the batch is full: the step no longer grows, the rest queue.
    assert t.pace(40, 600, 200).itl_s == pytest.approx(itl[-1])


def test_saturation_past_max_num_seqs_queues_and_grows_ttft() -> None:
    t = twin(max_num_seqs=8)
    assert t.slots(600, 200) == 8
    below, at, past, further = (t.pace(n, 600, 200) for n in (4, 8, 12, 24))
    assert not below.saturated and not at.saturated
    assert past.saturated and past.queued == 4 and past.running == 8
    # Queued requests wait for those ahead to finish: TTFT jumps past the slots and keeps growing.
    assert past.ttft_s > 5 * at.ttft_s
    assert further.ttft_s > past.ttft_s


def test_a_small_kv_pool_saturates_before_max_num_seqs() -> None:
    t = twin(max_num_seqs=256, gpu_memory_utilization=0.25)
    slots = t.slots(4000, 4000)
    assert 1 <= slots < 256  # the KV pool, not max_num_seqs, bounds the batch at this length
    assert not t.pace(slots, 4000, 4000).saturated
    assert t.pace(slots + 1, 4000, 4000).saturated


def test_ttft_grows_with_prompt_length() -> None:
    t = twin()
    ttft = [t.pace(1, n, 100).ttft_s for n in (64, 512, 2048, 6000)]
    assert all(a < b for a, b in itertools.pairwise(ttft))


def test_data_parallel_replicas_share_the_load() -> None:
    one, two = twin(), twin(data_parallel_size=2)
    assert two.slots(600, 200) == 2 * one.slots(600, 200)
    assert two.pace(16, 600, 200).itl_s == pytest.approx(one.pace(8, 600, 200).itl_s)
    assert one.pace(24, 600, 200).saturated and not two.pace(24, 600, 200).saturated


def test_noise_is_one_seeded_factor_within_three_sigma() -> None:
    factors = [noise_factor(RUN_SPREAD_SIGMA, seed) for seed in range(200)]
    bound = math.exp(NOISE_CLIP_SIGMAS * RUN_SPREAD_SIGMA)
    assert all(1 / bound <= f <= bound for f in factors)
    assert len(set(factors)) > 100  # seeds draw different runs
    assert noise_factor(RUN_SPREAD_SIGMA, 7) == noise_factor(RUN_SPREAD_SIGMA, 7)
    assert noise_factor(1.0, 3) <= math.exp(NOISE_CLIP_SIGMAS)  # clipped however wide the spread
    quiet, noisy = twin(), Twin(TwinConfig(gpu="H100-SXM", model=LLAMA_8B, seed=5, engine_args={"max_num_seqs": 16, "max_model_len": 8192}))  # fmt: skip
    assert noisy.pace(4, 600, 200).itl_s == pytest.approx(quiet.pace(4, 600, 200).itl_s * noisy.factor)
    assert noisy.factor != 1.0


def test_the_fakes_launch_args_fill_the_configuration() -> None:
    argv = ["--model", LLAMA_8B, "--port", "8000", "--max-num-seqs", "4", "--no-enable-chunked-prefill",
            "--max-model-len=8192", "--tensor-parallel-size", "2"]  # fmt: skip
    assert engine_args_from_argv(argv)["enable_chunked_prefill"] is False
    t = twin_from_env(json.dumps({"gpu": "H100-SXM"}), argv)
    assert t.slots(600, 200) == 4 and t.replica.tp == 2 and not t.replica.chunked_prefill
    # What the JSON names wins over the launch arguments.
    assert twin_from_env(json.dumps({"gpu": "H100-SXM", "engine_args": {"max_num_seqs": 9}}), argv).slots(600, 200) == 9


@pytest.mark.parametrize(
    ("raw", "says"),
    [("{gpu: 1", "not JSON"), ('{"gpu": "H100-SXM", "colour": 1}', "colour"), ('{"gpu": "H100-SXM"}', "model")],
)
def test_a_bad_twin_is_one_line_and_exit_2(raw: str, says: str, monkeypatch, capsys) -> None:
    with pytest.raises(UserError, match=says):
        twin_from_env(raw, [])
    monkeypatch.setenv("SERVETUNE_FAKE_TWIN", raw)
    with pytest.raises(SystemExit) as exit_:
        main(["--port", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: SERVETUNE_FAKE_TWIN") and says in err and "\n" not in err


def test_the_fake_serves_at_the_twins_pace() -> None:
    t = twin()
    prompt = " ".join(["word"] * 4000)  # the fake counts a prompt's tokens as its words
    n_out = 8
    expected = t.pace(1, 4000, n_out)
    assert expected.ttft_s > 5 * 0.020  # well apart from the fake's own 20 ms default
    fake = FakeOpenAI(twin=t)
    with serve_fake(fake) as url:
        began = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n_out}, timeout=30) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text"' in line and first is None:
                    first = time.perf_counter() - began
        total = time.perf_counter() - began
        assert fake.in_flight == 0 and fake.finished == 1
    # The fake sleeps to the twin's schedule: neither token can come before it.
    assert first is not None and first >= expected.ttft_s
    assert total >= expected.ttft_s + (n_out - 1) * expected.itl_s


def test_factor_scale_paces_the_twin_by_the_shipped_factors_scaled_per_term() -> None:
    """A GPU unlike the fit: half the shipped decode bandwidth and twice the step overhead slow every decode step
    by the roofline's own terms, and leave the factors it does not name as shipped."""
    args = {"max_num_seqs": 16, "max_model_len": 8192}
    scale = {"decode_bandwidth": 0.5, "step_overhead_ms": 2.0}
    shipped, slow = twin(), Twin(TwinConfig(gpu="H100-SXM", model=LLAMA_8B, engine_args=args, spread=0.0,
                                            factor_scale=scale))  # fmt: skip
    assert slow.efficiency.decode_bandwidth == pytest.approx(shipped.efficiency.decode_bandwidth * 0.5)
    assert slow.efficiency.step_overhead_ms == pytest.approx(shipped.efficiency.step_overhead_ms * 2)
    assert slow.efficiency.prefill_flops == shipped.efficiency.prefill_flops
    for n in (1, 8, 16):  # a decode step of 8B weights is bandwidth-bound: close to twice as long (its overheads)
        ratio = slow.pace(n, 600, 200).itl_s / shipped.pace(n, 600, 200).itl_s
        assert 1.6 < ratio < 2.1
    assert twin_from_env(json.dumps({"gpu": "H100-SXM", "factor_scale": scale}), ["--model", LLAMA_8B]).efficiency \
        == slow.efficiency  # fmt: skip


@pytest.mark.parametrize(
    ("scale", "says"),
    [
        ({"decode_bw": 0.5}, "factor_scale: Value error, decode_bw: not an efficiency factor"),
        ({"prefill_flops": -1}, "factor_scale: Value error, prefill_flops: its multiplier -1.0 is not a positive"),
        (
            {"decode_bandwidth": 2},
            "factor_scale: decode_bandwidth: {shipped} x 2.0 = {twice:.4g}: Input should be less",
        ),
    ],
)
def test_a_bad_factor_scale_is_one_line(scale, says) -> None:
    shipped = load_factors().for_class("H100").decode_bandwidth  # the shipped H100 factor the scale would double
    says = re.escape(says.format(shipped=shipped, twice=2 * shipped))
    with pytest.raises(UserError, match="^SERVETUNE_FAKE_TWIN: " + says) as err:
        twin_from_env(json.dumps({"gpu": "H100-SXM", "factor_scale": scale}), ["--model", LLAMA_8B])
    assert "\n" not in str(err.value)
