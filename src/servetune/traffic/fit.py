"""What a request log says about its traffic: lengths, arrivals, shared prefix, conversations.

Pure: :func:`profile` takes the log's requests (``traffic.log``) and returns plain data; the
``workload from-log`` command writes it as a workload.

- **Arrivals**: the mean rate is (arrivals - 1) / the time from the first to the last; the
  burstiness is the coefficient of variation (CV) of the gaps between arrivals. Poisson gaps
  have CV 1; where the measured CV is within :func:`poisson_tolerance` of 1 the process is
  Poisson, else gamma with shape 1/CV² (servetune's ``burstiness``: < 1 is burstier). With
  conversations, the arrivals are the conversations' first turns.
- **Conversations** (requests with a session id): turns per conversation, and the think time
  between a turn's answer and the next turn (the gap between the two sends, less the first's
  duration where the log has one). Where later turns' input counts include the conversation so
  far (the usual case: a chat client sends the whole history), each turn's own new message is
  its input less the previous turn's input and output.
- **Shared prefix** (needs prompt texts): the longest run of prompts, in sorted order, whose
  neighbours share at least ``min_chars`` leading characters; the prefix is what the whole run
  shares, and its fraction the run's share of the prompts (first turns only, with conversations:
  later turns share their own history, which the sessions model produces).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from servetune.traffic.log import LogError, LoggedRequest

#: Counts the tokens of a text (the served model's tokenizer).
Counter = Callable[[str], int]

#: A shared prefix shorter than this many characters is not reported (it is a greeting, not a template).
MIN_PREFIX_CHARS = 32

#: Later turns carry the history when at least this share of them has an input at least the
#: previous turn's input and output.
HISTORY_SHARE = 0.8


@dataclass(frozen=True)
class ArrivalFit:
    arrivals: int
    span_s: float
    rate: float  # arrivals per second
    cv: float  # coefficient of variation of the gaps
    process: str  # poisson | gamma

    @property
    def burstiness(self) -> float:
        """The gamma shape servetune's ``burstiness`` means: 1/CV² (1 for Poisson)."""
        return 1.0 if self.process == "poisson" else 1.0 / self.cv**2


@dataclass(frozen=True)
class PrefixFit:
    text: str
    tokens: int
    fraction: float
    estimated: bool  # tokens estimated from characters (no tokenizer)


@dataclass(frozen=True)
class SessionFit:
    turns: list[int]  # per conversation
    think_times_s: list[float]  # between turns
    carries_history: bool
    think_includes_response: bool  # the log has no durations: think times include the answer's time


@dataclass(frozen=True)
class TrafficProfile:
    requests: int
    input_tokens: list[int]  # per request (each later turn's new message, with conversations)
    output_tokens: list[int]
    first_turn: list[bool]  # per request: on its own, or a conversation's first turn
    arrival: ArrivalFit
    prefix: PrefixFit | None
    prefix_note: str  # why no prefix was measured, or how it was
    sessions: SessionFit | None


def poisson_tolerance(gaps: int) -> float:
    """How far from 1 a measured CV may be and still be Poisson: about two standard errors."""
    return max(0.1, 2.0 / np.sqrt(max(gaps, 1)))


def fit_arrival(times: Sequence[float]) -> ArrivalFit:
    ordered = np.sort(np.asarray(times, dtype=float))
    gaps = np.diff(ordered)
    span = float(ordered[-1] - ordered[0]) if len(ordered) else 0.0
    if len(gaps) < 1 or span <= 0:
        raise ValueError("every arrival has the same time: no rate can be measured")
    mean = float(gaps.mean())
    cv = float(gaps.std(ddof=1) / mean) if len(gaps) > 1 else 1.0
    process = "poisson" if abs(cv - 1.0) <= poisson_tolerance(len(gaps)) or cv == 0 else "gamma"
    return ArrivalFit(arrivals=len(ordered), span_s=span, rate=len(gaps) / span, cv=cv, process=process)


def shared_prefix(prompts: Sequence[str], min_chars: int = MIN_PREFIX_CHARS) -> tuple[str, int] | None:
    """The prefix most prompts share (at least ``min_chars`` long) and how many share it; None if none."""
    ordered = sorted(prompts)
    best: tuple[int, int, str] | None = None  # (members, length, text)
    start, shared = 0, None
    for i in range(1, len(ordered) + 1):
        lcp = _common(ordered[i - 1], ordered[i]) if i < len(ordered) else 0
        if lcp >= min_chars:
            shared = lcp if shared is None else min(shared, lcp)
            continue
        if shared is not None:
            members = i - start
            if best is None or (members, shared) > best[:2]:
                best = (members, shared, ordered[start][:shared])
        start, shared = i, None
    return None if best is None else (best[2], best[0])


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _lengths(requests: Sequence[LoggedRequest], count: Counter | None, source: str) -> tuple[list[int], list[int]]:
    inputs, outputs = [], []
    for r in requests:
        if (r.input_tokens is None or r.output_tokens is None) and count is None:
            raise LogError(f"{source} line {r.line}: has texts but no token counts; pass --tokenizer to count them")
        inputs.append(_size(r.input_tokens, r.prompt, count))
        outputs.append(_size(r.output_tokens, r.output, count))
    return inputs, outputs


def _size(tokens: int | None, text: str | None, count: Counter | None) -> int:
    """A request's token count as logged, else its text's as ``count`` counts it (``_lengths`` has seen that
    there is a ``count``; ``parse_record``, that a record without the count has the text)."""
    if tokens is not None:
        return tokens
    assert count is not None and text is not None
    return count(text)


def profile(requests: Sequence[LoggedRequest], count: Counter | None = None, source: str = "the log") -> TrafficProfile:
    """The traffic of ``requests`` (in time order, as ``read_log`` returns them)."""
    inputs, outputs = _lengths(requests, count, source)
    index = {id(r): i for i, r in enumerate(requests)}
    conversations: dict[str, list[LoggedRequest]] = {}
    for r in requests:
        if r.session is not None:
            conversations.setdefault(r.session, []).append(r)
    sessions = None
    first_turns = list(requests)
    if conversations:
        singles = [[r] for r in requests if r.session is None]
        groups = list(conversations.values()) + singles
        first_turns = sorted((g[0] for g in groups), key=lambda r: r.time_s)
        later = [(g[k - 1], g[k]) for g in groups for k in range(1, len(g))]
        grows = sum(inputs[index[id(b)]] >= inputs[index[id(a)]] + outputs[index[id(a)]] for a, b in later)
        carries = bool(later) and grows >= HISTORY_SHARE * len(later)
        new_inputs = list(inputs)
        if carries:
            for a, b in later:
                new_inputs[index[id(b)]] = max(1, inputs[index[id(b)]] - inputs[index[id(a)]] - outputs[index[id(a)]])
        inputs = new_inputs
        thinks = [max(0.0, b.time_s - a.time_s - (a.duration_s or 0.0)) for a, b in later]
        sessions = SessionFit(
            turns=[len(g) for g in groups], think_times_s=thinks, carries_history=carries,
            think_includes_response=any(a.duration_s is None for a, _ in later),
        )  # fmt: skip
    try:
        arrival = fit_arrival([r.time_s for r in first_turns])
    except ValueError as exc:
        raise LogError(f"{source}: {exc}") from None
    prefix, note = _prefix(requests, first_turns, inputs, count)
    firsts = {id(r) for r in first_turns}
    return TrafficProfile(
        len(requests), inputs, list(outputs), [id(r) in firsts for r in requests], arrival, prefix, note, sessions
    )


def _prefix(requests: Sequence[LoggedRequest], first_turns: Sequence[LoggedRequest], inputs: list[int],
            count: Counter | None) -> tuple[PrefixFit | None, str]:  # fmt: skip
    prompts = [r.prompt for r in first_turns if r.prompt is not None]
    if len(prompts) < len(first_turns) or len(prompts) < 2:
        return None, "not measured: the log has no prompt texts"
    found = shared_prefix(prompts)
    if found is None:
        return None, f"none: no {MIN_PREFIX_CHARS} leading characters are shared by two prompts"
    text, members = found
    if count is not None:
        tokens, estimated = count(text), False
    else:
        with_both = [(r.input_tokens, len(r.prompt)) for r in requests if r.input_tokens and r.prompt]
        per_char = sum(t for t, _ in with_both) / max(sum(c for _, c in with_both), 1)
        tokens, estimated = max(1, round(len(text) * per_char)), True
    fraction = members / len(prompts)
    how = "estimated from characters (pass --tokenizer to count)" if estimated else "counted"
    return PrefixFit(text, tokens, fraction, estimated), f"measured from the prompt texts, tokens {how}"
