"""From step times to what a client measures: TTFT, TPOT, throughput, under a closed or open loop.

In steady state a replica holds ``n`` requests at once (at most ``max_num_seqs`` and what the KV
cache holds at the request's full length). Each request needs I prompt tokens and O decode steps,
so every step decodes ``n`` tokens and, on average, prefills ``n x I / O`` prompt tokens; the
step's time is the client's TPOT (ITL is the same on average). With a drafter a step yields the accepted
length L of tokens a sequence (roofline.py ``tokens_per_step``): it prefills ``n x I x L / O`` and TPOT is
the step's time over L. A prompt enters in chunks of the
step's token budget left after the decodes (``max_num_batched_tokens - n``) with chunked prefill,
or whole in a step of its own without. A request spends TTFT_engine + (O - 1) x TPOT in the
replica, so it completes ``n / that`` requests per second (Little's law).

- Closed loop, C clients per replica: n = min(C, capacity); the other C - n wait in the queue,
  so the client's E2E is C / throughput and its TTFT is that E2E less the decode time. Clients whose
  requests finish in the same step send the next ones together: a share ``closed_loop_waves`` of the
  prompts (fitted; 0 for the GPU classes, whose public points do not pin it) arrives in waves that
  prefill first come, first served in steps of their own, so their prefill lands in TTFT, not in
  the running decodes' TPOT (vLLM's CPU build with fixed output lengths: TPOT grows with the batch
  as the decode step alone does). The wave's prefill is work every request of it waits for: a
  prompt prefilled early decodes through the steps that prefill the rest, so what its TTFT does
  not hold, its TPOT does. A small step budget moves wave time from TTFT into TPOT and adds a
  step overhead per step; it does not shorten the request (``wave_prefill``).
- Open loop, R requests/s per replica: the ``n`` (bisected) whose throughput equals R; past the
  capacity's throughput the queue grows without bound (saturated, TTFT unbounded). Below it, random
  arrivals still find every slot taken at times: a request then waits for one before its prefill
  starts (:func:`slot_wait_s`, the G/G/c queue of the capacity's slots), in its TTFT; a level of N requests
  that starts on an empty queue waits less than the long run near capacity (:func:`level_share`).
- The knee: the smallest concurrency whose throughput reaches 90 % of the capacity's.

A request with images first has them encoded by the vision tower (``encode``: seconds per request, from
estimate/encoder.py): in the step that starts its prefill, so in its TTFT. That is prefill work like its
prompt's: spread over the steps the running requests decode through (their TPOT), or in a wave's prefill steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servetune.estimate.factors import Efficiency
from servetune.estimate.pipeline import chunked_prompt_s
from servetune.estimate.roofline import Replica, decode_s, prefill_s, prefill_token_s, tokens_per_step

KNEE_FRACTION = 0.9


@dataclass(frozen=True)
class Steady:
    """A replica holding ``in_flight`` requests: the engine's side of every figure."""

    in_flight: float
    tpot_s: float
    ttft_s: float  # from admission to the first token, no queueing

    def residence_s(self, output_tokens: int) -> float:
        return self.ttft_s + (output_tokens - 1) * self.tpot_s

    def request_rate(self, output_tokens: int) -> float:
        return self.in_flight / self.residence_s(output_tokens)


def capacity(rep: Replica, input_tokens: int, output_tokens: int) -> int:
    """Requests one replica runs at once: max_num_seqs, or fewer where the KV cache runs out."""
    if rep.kv_cache_tokens is None:
        return rep.max_num_seqs
    return max(1, min(rep.max_num_seqs, rep.kv_cache_tokens // (input_tokens + output_tokens)))


def steady(
    rep: Replica,
    eff: Efficiency,
    in_flight: float,
    input_tokens: int,
    output_tokens: int,
    waves: float = 0.0,
    encode: float = 0.0,
) -> Steady:
    """Step time and TTFT with ``in_flight`` requests decoding and arriving at the rate they finish.

    ``waves`` is the share of the prompts that arrive together and prefill in steps of their own
    (:func:`wave_ttft_s`) instead of one by one beside the decodes (a closed loop's synchronised
    clients, ``Efficiency.closed_loop_waves``): their prefill is then in TTFT, not in every step's TPOT.
    ``encode``: seconds the vision tower takes for a request's images (0: text), prefill work before its prompt's.
    """
    n = max(in_flight, 1e-9)
    context = input_tokens + output_tokens / 2
    decode = decode_s(rep, eff, n, context)
    per_prompt_token = prefill_token_s(rep, eff, input_tokens)
    # A step yields ``tokens_per_step`` tokens a sequence (1 without a drafter), and prefills prompts in proportion.
    yielded = tokens_per_step(rep)
    prefill_per_step = (1.0 - waves) * n * input_tokens * yielded / output_tokens
    encode_per_step = (1.0 - waves) * n * encode * yielded / output_tokens
    tpot = (decode + prefill_per_step * per_prompt_token + encode_per_step) / yielded
    if rep.chunked_prefill:
        chunk = max(rep.max_num_batched_tokens - n, 1.0)
        steps = math.ceil(input_tokens / chunk)
        ttft = chunked_prompt_s(rep.pp, steps, decode, input_tokens, chunk, per_prompt_token) + encode + tpot / 2
    else:
        ttft = prefill_s(rep, eff, input_tokens, input_tokens) + encode + tpot / 2
    if waves > 0:
        first_token, decoded_through = wave_prefill(rep, eff, n, input_tokens, encode)
        ttft = (1.0 - waves) * ttft + waves * first_token
        tpot += waves * decoded_through / max(output_tokens - 1, 1) / yielded
    return Steady(in_flight=in_flight, tpot_s=max(tpot, host_bound_tpot_s(rep, eff, n)), ttft_s=ttft)


def host_bound_tpot_s(rep: Replica, eff: Efficiency, in_flight: float) -> float:
    """The least TPOT the host's cores allow ``in_flight`` requests (0 where not counted).

    On the CPU build the engine, its API server and the load client share the host's cores: each streamed token
    costs ``host_cpu_ms_per_token`` of CPU among them, so the cores stream at most ``cores / that`` tokens a second,
    whatever the engine's slots, and a step of n sequences takes at least ``n x that / cores``. Past that the
    throughput stays flat and E2E grows with the clients: the knee comes where the cores saturate, before the slots
    do. The cores are given or measured per host (``DeviceRates.cores``), as its FLOP/s are; the cost is fitted."""
    cores = rep.rates.cores
    if not cores or eff.host_cpu_ms_per_token <= 0:
        return 0.0
    return in_flight * eff.host_cpu_ms_per_token / 1e3 / cores


def wave_ttft_s(rep: Replica, eff: Efficiency, in_flight: float, input_tokens: int, encode: float = 0.0) -> float:
    """Mean TTFT of ``in_flight`` prompts that arrive together and prefill first come, first served."""
    return wave_prefill(rep, eff, in_flight, input_tokens, encode)[0]


def wave_prefill(
    rep: Replica, eff: Efficiency, in_flight: float, input_tokens: int, encode: float = 0.0
) -> tuple[float, float]:
    """``in_flight`` prompts that arrive together and prefill first come, first served: their mean time to the
    first token, and the mean prefill work of the wave's later steps, which a request decodes through.

    They fill steps of ``max_num_batched_tokens`` (whole prompts, at least one a step, without chunked
    prefill); each prompt's first token comes at the end of the step that finishes it, every step until
    then costing its fixed overhead. The wave's steps after that ride on the request's decode steps: they
    add their prefill work to its TPOT, and their overhead is the decode step's own. A prompt's images
    (``encode`` seconds) are encoded in the steps that prefill it, in proportion to its tokens each takes.
    """
    n = max(1, round(in_flight))
    budget = max(rep.max_num_batched_tokens, 1)
    whole_prompts = max(1, budget // input_tokens) * input_tokens
    per_step = float(budget if rep.chunked_prefill else whole_prompts)
    total = n * input_tokens
    overhead = eff.step_overhead_ms / 1e3
    elapsed, work, done, step_end, work_end = 0.0, 0.0, 0.0, [], []
    while done < total:
        tokens = min(per_step, total - done)
        step = prefill_s(rep, eff, tokens, input_tokens) + encode * tokens / input_tokens
        elapsed, work, done = elapsed + step, work + step - overhead, done + tokens
        step_end.append(elapsed)
        work_end.append(work)
    firsts = [min(math.ceil(k * input_tokens / per_step), len(step_end)) - 1 for k in range(1, n + 1)]
    return sum(step_end[i] for i in firsts) / n, sum(work - work_end[i] for i in firsts) / n


@dataclass(frozen=True)
class Point:
    """What one replica serves under a load: the client's view."""

    ttft_s: float | None
    tpot_s: float
    request_rate: float
    saturated: bool
    in_flight: float
    preempting: bool


def closed_loop(
    rep: Replica, eff: Efficiency, clients: float, input_tokens: int, output_tokens: int, encode: float = 0.0
) -> Point:
    cap = capacity(rep, input_tokens, output_tokens)
    n = min(clients, cap)
    s = steady(rep, eff, n, input_tokens, output_tokens, eff.closed_loop_waves, encode)
    rate = s.request_rate(output_tokens)
    e2e = clients / rate
    ttft = e2e - (output_tokens - 1) * s.tpot_s
    return Point(
        ttft,
        s.tpot_s,
        rate,
        saturated=clients > cap,
        in_flight=n,
        preempting=_preempts(rep, clients, input_tokens, output_tokens),
    )


def slot_wait_s(
    in_flight: float,
    slots: int,
    service_s: float,
    arrival_cv2: float = 1.0,
    service_cv2: float = 0.0,
    requests: float | None = None,
) -> float:
    """Mean time a request of an open loop waits for one of a replica's ``slots`` before its prefill starts.

    The replica is a G/G/c server: c = ``slots`` requests run at once (``capacity``), each for its residence
    ``service_s`` (TTFT_engine + (O - 1) x TPOT at the operating batch), and arrivals come at rate
    lambda = ``in_flight`` / ``service_s`` (Little's law: ``in_flight`` is the mean number of slots busy, the
    offered load a = lambda x S, and the utilisation rho = a / c). A request that finds every slot busy waits
    in vLLM's queue. For Poisson arrivals and exponential service (M/M/c) the mean wait is Erlang's C formula,
    W = C(c, a) x S / (c - a), where C(c, a) is the chance an arrival finds all c busy. The Allen-Cunneen
    approximation carries it to general arrivals and service, scaled by their squared coefficients of
    variation: W ~ C(c, a) x S / (c - a) x (ca^2 + cs^2) / 2. With one slot C(1, a) = rho and this is
    Kingman's formula, rho / (1 - rho) x S x (ca^2 + cs^2) / 2 (Pollaczek-Khinchine's, exact, for Poisson).

    ``arrival_cv2`` (ca^2): 1 for Poisson arrivals, 1 / shape for gamma gaps (a workload's ``burstiness``),
    0 for evenly spaced ones. ``service_cv2`` (cs^2): 0 for requests of fixed lengths, whose residence varies
    little (the default: the load is its mean lengths), 1 for exponentially spread output lengths.
    So the wait is ~0 at low utilisation, grows without bound as rho -> 1 (W ~ S x (ca^2 + cs^2) / 2 /
    (c (1 - rho)) there), and scales with the arrivals' burstiness. C(c, a) comes from Erlang's B by its
    stable recursion, B(0) = 1, B(k) = a B(k-1) / (k + a B(k-1)); C = c B / (c - a (1 - B)).

    ``requests``: a level of that many arrivals, starting on an empty queue (None: the long run). Near rho = 1
    the queue takes longer to build up than such a level lasts, so its requests wait less on average than the
    long run's W (:func:`level_share`); the result is W times that share, so never above W. The queue starts to
    build once the empty engine's slots have filled, about one residence into the level: the level's first
    ``service_s`` seconds wait nothing (on many slots a level of a few hundred requests lasts only a few residences:
    without that the finite level's wait was 1.5-2.1x a simulated FIFO M/D/c's at 0.98-0.995 of capacity on 32 and
    64 slots, with it 1.2-1.4x; bench/README.md).
    """
    c = max(int(slots), 1)
    a = max(in_flight, 0.0)
    if a >= c:
        return math.inf
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    erlang_c = c * b / (c - a * (1.0 - b))
    cv2 = arrival_cv2 + service_cv2
    wait = erlang_c * service_s / (c - a) * cv2 / 2.0
    if requests is None or wait <= 0.0 or a <= 0.0:
        return wait
    # The queue in heavy traffic: a reflected Brownian motion with drift -(c - a) / S (the slots' spare rate)
    # and variance lambda x (ca^2 + cs^2), lambda = a / S; it relaxes on the time scale variance / drift^2.
    relaxation_s = a * cv2 * service_s / (c - a) ** 2
    level_s = requests * service_s / a
    # An empty engine's slots fill over about one residence (the requests sent so far, all still running, are
    # lambda x t < a < c busy slots at t < S): the queue starts to build a residence into the level, not at its start.
    building_s = level_s - service_s
    if building_s <= 0.0:
        return 0.0
    return wait * building_s / level_s * level_share(building_s / relaxation_s)


def level_share(span: float) -> float:
    """The mean wait of a level's arrivals over the long run's, for a level ``span`` relaxation times long.

    A queue that starts empty builds up: in heavy traffic it is a reflected Brownian motion (drift -theta,
    variance sigma^2) started at 0, whose mean at time t over its long-run mean sigma^2 / (2 theta) is, in
    u = t theta^2 / sigma^2 (Abate and Whitt, "Transient behavior of regulated Brownian motion I", 1987),
    H(u) = 1 - 2 [(1 + u) Phi^c(sqrt u) - sqrt u phi(sqrt u)]: 0 at the start, 0.85 after one relaxation time,
    1 in the long run. A request waits what the queue ahead of it holds over the rate the slots free, so the
    level's arrivals, evenly spread over its ``span``, wait on average the mean of H over [0, span] times the
    long run's wait. Integrated by Simpson's rule in v = sqrt u (H grows as sqrt u near 0).
    """
    if span <= 0.0:
        return 0.0
    if span > 50.0:  # H within 1e-12 of 1 past u = 50: the mean of H is 1 - the transient's area over the span
        return max(0.0, 1.0 - _TRANSIENT_AREA / span)
    top = math.sqrt(span)
    steps = 32
    width = top / steps
    total = 0.0
    for k in range(steps + 1):
        v = k * width
        weight = 1 if k in (0, steps) else (4 if k % 2 else 2)
        total += weight * _relaxed(v * v) * 2 * v
    return total * width / 3 / span


def _relaxed(u: float) -> float:
    """H(u): a reflected Brownian motion's mean u relaxation times after it starts at 0, over its long-run mean."""
    root = math.sqrt(u)
    tail = 0.5 * math.erfc(root / math.sqrt(2.0))
    density = math.exp(-u / 2) / math.sqrt(2 * math.pi)
    return 1.0 - 2.0 * ((1.0 + u) * tail - root * density)


_TRANSIENT_AREA = 0.5  # the integral of 1 - H(u) over u >= 0 (the shortfall's mean relaxation time is 1/2)


def open_loop(
    rep: Replica,
    eff: Efficiency,
    rate: float,
    input_tokens: int,
    output_tokens: int,
    encode: float = 0.0,
    arrival_cv2: float = 1.0,
    requests: float | None = None,
) -> Point:
    """R requests/s per replica: the batch that serves them, and TTFT with the wait for a slot
    (:func:`slot_wait_s`; ``arrival_cv2`` the arrivals' squared coefficient of variation, 1 for Poisson;
    ``requests`` the level's arrivals per replica, a finite level's wait, None the long run's)."""
    cap = capacity(rep, input_tokens, output_tokens)
    full = steady(rep, eff, cap, input_tokens, output_tokens, encode=encode)
    if rate >= full.request_rate(output_tokens):
        rate_max = full.request_rate(output_tokens)
        return Point(
            None, full.tpot_s, rate_max, True, cap, _preempts(rep, rep.max_num_seqs, input_tokens, output_tokens)
        )
    lo, hi = 0.0, float(cap)
    for _ in range(60):
        mid = (lo + hi) / 2
        if steady(rep, eff, mid, input_tokens, output_tokens, encode=encode).request_rate(output_tokens) < rate:
            lo = mid
        else:
            hi = mid
    s = steady(rep, eff, hi, input_tokens, output_tokens, encode=encode)
    wait = slot_wait_s(hi, cap, s.residence_s(output_tokens), arrival_cv2, requests=requests)
    if not math.isfinite(wait):  # the rate is within the bisection's precision of the capacity's
        return Point(None, s.tpot_s, rate, True, cap, _preempts(rep, rep.max_num_seqs, input_tokens, output_tokens))
    return Point(s.ttft_s + wait, s.tpot_s, rate, saturated=False, in_flight=hi, preempting=False)


def knee(rep: Replica, eff: Efficiency, input_tokens: int, output_tokens: int, encode: float = 0.0) -> int:
    """The smallest concurrency whose request throughput reaches 90 % of the replica's capacity (closed loop)."""
    cap = capacity(rep, input_tokens, output_tokens)
    waves = eff.closed_loop_waves
    best = steady(rep, eff, cap, input_tokens, output_tokens, waves, encode).request_rate(output_tokens)
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi) // 2
        rate = steady(rep, eff, mid, input_tokens, output_tokens, waves, encode).request_rate(output_tokens)
        if rate >= KNEE_FRACTION * best:
            hi = mid
        else:
            lo = mid + 1
    return lo


def static_batch_s(
    rep: Replica, eff: Efficiency, batch: int, input_tokens: int, output_tokens: int
) -> tuple[float, float]:
    """An offline batch started together (``benchmark_latency``): prefill time and end-to-end time.

    The prompts prefill in steps of at most ``max_num_batched_tokens``; then O decode steps whose
    context grows from I to I + O (integrated with Simpson's rule over the steps).
    """
    tokens = batch * input_tokens
    steps = max(1, math.ceil(tokens / max(rep.max_num_batched_tokens, input_tokens)))
    prefill = steps * prefill_s(rep, eff, tokens / steps, input_tokens)
    first, mid, last = (decode_s(rep, eff, batch, input_tokens + k) for k in (0, output_tokens / 2, output_tokens))
    decode = (output_tokens - 1) / tokens_per_step(rep) * (first + 4 * mid + last) / 6
    return prefill, prefill + decode


def _preempts(rep: Replica, demand: float, input_tokens: int, output_tokens: int) -> bool:
    """Whether vLLM admits more requests than the KV cache holds at full length, and so preempts.

    vLLM admits a request on the blocks it uses now; as the admitted requests grow, some are
    preempted and recomputed. The estimate keeps the in-flight count at what fits (``capacity``).
    """
    if rep.kv_cache_tokens is None:
        return False
    return min(demand, rep.max_num_seqs) * (input_tokens + output_tokens) > rep.kv_cache_tokens
