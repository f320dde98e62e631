"""The load ladder: a generator that yields the next level and is sent the measured result.

Early stopping lives here, in one place: stop climbing once a level breaks the SLO, once it is
saturated, or when the study's own ``stop_rule`` gives a reason (a level finished trials
dominate, say). Saturated means a higher level could not serve more:

- **rate** (an open loop): the engine fell behind the offered rate. Arrivals do not wait for
  answers, so an engine that keeps up holds TTFT level through the level, and one that finishes
  only ``m`` of ``r`` req/s queues the rest: TTFT grows by ``r/m - 1`` seconds per second sent
  (``LevelSummary.ttft_growth``). The level is saturated when even the low end of that growth's
  95% confidence interval exceeds the level's noise margin (results.py ``noise_margin``: the
  engine finished clearly less than the offered rate), or when the level itself was cut because
  vLLM's waiting queue kept growing (trial/measure.py ``EarlyBreak``). Output throughput is not
  compared here: over [first send, last answer] it holds the level's drain, about one end-to-end
  latency, which weighs more the shorter the sending span, so the measured gain of a doubled rate
  shrinks under any threshold while the engine still keeps up.
- **concurrency** (a closed loop): output throughput with every client busy
  (``LevelSummary.busy_output_throughput``, the staggered start and the last wave left out) grew
  less than ``min_gain`` over the best level so far. A level too short for that window, or
  recorded before it was kept, is judged on its whole-level output throughput.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from servetune.accounting import stop_cause
from servetune.load.runner import Level
from servetune.results import LevelResult, noise_margin


def ladder(
    levels: Sequence[Level],
    *,
    stop_on_slo_break: bool = True,
    min_gain: float = 0.0,
    stop_rule: Callable[[LevelResult], str | None] | None = None,
) -> Generator[Level, LevelResult, str | None]:
    """Yield levels in order; ``send`` each level's result. Returns why it stopped early, if it did."""
    best_throughput = 0.0
    for index, level in enumerate(levels):
        result = yield level
        if index == len(levels) - 1:
            break
        summary = result.summary
        if summary.completed == 0:
            return f"no request completed at {level}"
        if stop_on_slo_break and not result.meets_slo:
            return f"SLO broken at {level}: {'; '.join(result.slo_violations)}"
        if level.kind == "rate":
            reason = fell_behind(level, result)
            if reason:
                return f"saturated at {level}: {reason}"
        else:
            throughput = busy_throughput(result)
            if best_throughput > 0 and throughput < best_throughput * (1 + min_gain):
                return (f"saturated at {level}: output throughput {throughput:.1f} tok/s, best so far "
                        f"{best_throughput:.1f} (less than {min_gain:.0%} more)")  # fmt: skip
            best_throughput = max(best_throughput, throughput)
        reason = stop_rule(result) if stop_rule is not None else None
        if reason:
            return reason
    return None


def busy_throughput(result: LevelResult) -> float:
    """A closed-loop level's output tok/s with every client busy, else over the whole level."""
    return result.summary.steady_output_throughput


def fell_behind(level: Level, result: LevelResult) -> str | None:
    """Why an open-loop level shows the engine could not keep up with its rate (None: it kept up)."""
    stopped = result.stopped_early
    # "saturated: vLLM's waiting queue grew ...: stopped early"
    if stopped is not None and stop_cause(stopped) == "saturated":
        return f"{stopped.removeprefix('saturated: ').removesuffix(': stopped early')} (the level was cut)"
    summary = result.summary
    margin = noise_margin(result)
    if summary.ttft_growth is None or summary.ttft_growth_low is None or summary.ttft_growth_low <= margin:
        return None  # (the two are measured together)
    sent = summary.completed + summary.failed
    offered = (sent - 1) / summary.send_span_s if summary.send_span_s else level.value
    return (f"TTFT grew {summary.ttft_growth:.2f} s per second sent (at least {summary.ttft_growth_low:.2f}, over "
            f"the {margin:.0%} noise margin): the engine finished about {offered / (1 + summary.ttft_growth):.3g} "
            f"of the {offered:.3g} req/s sent")  # fmt: skip
