"""The loads and workloads the stability scenarios (verify/scenarios.py) derive from the recommended level and
the study's workload: a level scaled up (the peak), the P99 input length and a mix with a share of requests at it
(the mix), a fixed-length workload (long outputs, disconnects), and the spread of the gaps between arrivals a
burst is judged by. Pure functions over typed inputs: nothing here sends a request."""

from __future__ import annotations

import math

import numpy as np

from servetune.config.workload import Arrival, Fixed, Workload
from servetune.load.runner import Level
from servetune.metrics import RequestRecord

LONG_SHARE = 0.10  # the mix's share of requests at the workload's P99 input length


def scaled(level: Level, factor: float) -> Level:
    """``level`` ``factor`` times higher (a closed loop by whole clients, at least one more)."""
    if level.kind == "concurrency":
        return Level("concurrency", float(max(level.value + 1, math.ceil(level.value * factor))))
    return Level("rate", level.value * factor, level.process, level.burstiness, level.max_concurrency)


def gap_cv(records: list[RequestRecord], scheduled: bool = False) -> float | None:
    """The coefficient of variation of the gaps between sends, as sent or (``scheduled``) as the open loop's schedule
    asked (requests without one left out): a busy host's late sends smooth the first, never the second."""
    times = [r.scheduled for r in records if r.scheduled is not None] if scheduled else [r.sent for r in records]
    sends = np.sort(np.asarray(times))
    gaps = np.diff(sends)
    return float(gaps.std() / gaps.mean()) if len(gaps) >= 2 and gaps.mean() > 0 else None


def p99_input_tokens(workload: Workload, seed: int = 0, samples: int = 20_000) -> int:
    """The workload's 99th percentile of input length (by sampling its classes, weighted)."""
    rng = np.random.default_rng(seed)
    classes = workload.classes
    weights = np.asarray([c.weight for c in classes], dtype=float)
    counts = rng.multinomial(samples, weights / weights.sum())
    lengths = np.concatenate([c.input_tokens.sample(rng, int(n)) for c, n in zip(classes, counts, strict=True) if n])
    return int(np.percentile(lengths, 99))


LONG_CLASS = "long"


def mixed_workload(workload: Workload, long_tokens: int) -> Workload:
    """The workload's classes at 90% of the weight, and a ``long`` class at its P99 input length. Each class keeps
    what its requests ask for (sampling, structured output, images); the long one asks what the first class does."""
    classes = workload.classes
    total = sum(c.weight for c in classes)
    kept = [c.model_copy(update={"name": c.name if c.name != LONG_CLASS else "short",
                                 "weight": c.weight * (1 - LONG_SHARE) / total}) for c in classes]  # fmt: skip
    long = classes[0].model_copy(
        update={"name": LONG_CLASS, "weight": LONG_SHARE, "input_tokens": Fixed(dist="fixed", value=long_tokens)}
    )
    return workload.model_copy(update={"input_tokens": None, "output_tokens": None, "mix": (*kept, long)})


def fixed_workload(workload: Workload, name: str, input_tokens: int, output_tokens: int) -> Workload:
    """Every request ``input_tokens`` in and exactly ``output_tokens`` out (EOS ignored), otherwise as the workload's
    requests are: their text, shared prefix, adapters, images and sampling. What would end a request before its
    length (stop sequences, structured output, whose grammar ends it) is left out, and so is ``n``, which would
    multiply its output; so are sessions, its arrival and its classes (one fixed class)."""
    sampling = workload.sampling.model_copy(update={"stop": None, "n": None, "ignore_eos": None})
    return workload.model_copy(update={
        "name": name, "ignore_eos": True, "input_tokens": Fixed(dist="fixed", value=input_tokens),
        "output_tokens": Fixed(dist="fixed", value=output_tokens), "mix": None, "sessions": None,
        "arrival": Arrival(), "sampling": sampling, "structured": None,
    })  # fmt: skip
