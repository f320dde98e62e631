"""The overload scenario against the fake engine: with an admission bound (the fake's max_num_queued_reqs,
503 past it, as vLLM's) the excess is refused at once, the admitted meet the TTFT bound and the engine
recovers when the load drops; without one every request queues and the scenario fails, naming it. The burst
against the same bound: its 503s are the bound's (verify/admitted.py), unless the engine refuses below it."""

import asyncio

from servetune.config.slo import Slo
from servetune.config.workload import Workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.testing.fake_openai import FakeOpenAI
from servetune.verify.admitted import refused
from servetune.verify.overload import overload
from servetune.verify.scenarios import Budget, Target, burst
from tests.conftest import serve_fake

WORKLOAD = Workload(
    name="chat", input_tokens={"dist": "fixed", "value": 16}, output_tokens={"dist": "fixed", "value": 16}
)
BUDGET = Budget(soak_s=4.0, windows=4, scenario_s=2.0, long_requests=2, long_output_cap=64, drop_rounds=1, repeats=5,
                repeat_s=1.0, warmup_cap=2)  # fmt: skip
# 2 requests at once, 16 tokens at 10 ms + 15 x 5 ms: about 23 req/s served, so 1.5 x 20 req/s overloads it. An
# admitted request waits behind at most 4 (the bound of 6 less the 2 running): about 2.5 x 85 ms + 10 ms, 0.22 s.
# The TTFT bound is 1 s: a stall of the host (the fake sleeps to a schedule, so a loaded host adds time once,
# bench/fake_pace_noise.py) of up to 0.78 s in the 2 s overload is still within it (at 0.5 s, 0.28 s was).
RATE = 20.0
BOUND_MS = 1000.0
SLO = Slo.parse(f"ttft_ms.p99={BOUND_MS:g}")


def run_overload(fake: FakeOpenAI, tokenizer, scenario=overload, admission=None):
    async def main(url):
        async with StreamingClient(url, "fake", timeout_s=60, first_token_timeout_s=30, idle_timeout_s=30) as client:
            target = Target(client=client, url=url, workload=WORKLOAD, prompts=PromptFactory(tokenizer), slo=SLO,
                            level=Level("concurrency", 2.0), budget=BUDGET, max_model_len=1024,
                            measured_rate=RATE, admission=admission or {})  # fmt: skip
            return await scenario(target), target.records

    with serve_fake(fake) as url:
        return asyncio.run(main(url))


def test_a_bounded_queue_refuses_the_excess_quickly_and_recovers(tiny_tokenizer):
    fake = FakeOpenAI(ttft_ms=10, itl_ms=5, max_num_seqs=2, max_num_queued_reqs=6)
    result, records = run_overload(fake, tiny_tokenizer)
    n = result.numbers
    assert result.passed, result.reason
    # every 503 the fake sent reached the client, in one phase or the other: the recovery phase may meet a queue the
    # overload left full on a busy host (census of 2026-12-08, load 21: 23 refused in the overload, 1 in the recovery)
    assert fake.rejected == sum(refused(r) for r in records) == n["refused"] + n["recovery_client_503"]
    assert n["refused"] > 0 and n["recovery_client_503"] == n["recovery_server_refused"]
    # the server's own count, read from its /metrics around each phase, agrees with the client's 503s
    assert n["server_refused_by_reason"] == {"max_num_queued_reqs": n["refused"], "max_num_queued_tokens": 0}
    assert n["refusals_agree"] and n["recovery_refusals_agree"] and f"refused {n['refused']}: " in result.reason
    assert n["admitted"] > 0 and n["admitted_ttft_ms_p99"] <= BOUND_MS and n["refuse_ms_p99"] <= BOUND_MS
    assert n["recovered"] and n["other_errors"] == 0
    # the load client's own stalls were followed over both phases (a verdict they account for is unsettled)
    assert n["unsettled"] is False and n["client_stall_ms_max"] >= 0.0 and n["client_stalled_s"] >= 0.0


def test_an_unbounded_queue_fails_and_says_so(tiny_tokenizer):
    result, _ = run_overload(FakeOpenAI(ttft_ms=10, itl_ms=5, max_num_seqs=2), tiny_tokenizer)
    assert not result.passed and result.numbers["refused"] == 0
    assert "no bound on the queue" in result.reason


def test_a_burst_against_the_bound_passes_with_its_refusals_set_apart(tiny_tokenizer):
    fake = FakeOpenAI(ttft_ms=10, itl_ms=5, max_num_seqs=2, max_num_queued_reqs=6)
    result, records = run_overload(fake, tiny_tokenizer, burst, {"max_num_queued_reqs": 6})
    n = result.numbers
    assert result.passed, result.reason
    assert n["refused"] == fake.rejected == sum(refused(r) for r in records) > 0  # CV 3 at 20 req/s fills 6
    assert n["refused_explained"] == n["refused"] and n["refused_unexplained"] == 0
    assert n["server_refused"] == n["refused"] and n["refusals_agree"], result.reason
    assert n["admitted_ttft_ms_p99"] <= BOUND_MS and n["refuse_ms_p99"] <= BOUND_MS, result.reason
    assert "explained by the bounds" in result.reason


def test_a_burst_refused_below_the_bound_it_was_given_fails(tiny_tokenizer):
    """The engine refuses at 3 in flight where the configuration says 6: more refusals than the bound explains."""
    fake = FakeOpenAI(ttft_ms=10, itl_ms=5, max_num_seqs=2, max_num_queued_reqs=3)
    result, _ = run_overload(fake, tiny_tokenizer, burst, {"max_num_queued_reqs": 6})
    assert not result.passed and result.numbers["refused_unexplained"] > 0, result.reason
    assert "refusals the bounds do not explain" in result.reason
