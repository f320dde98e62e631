"""The server's own count of the requests its admission bounds refused, beside the client's count of 503s.

verify judges its overload and burst scenarios from the 503s its load client received (verify/admitted.py
``refused``). vLLM 0.32 counts each refusal itself, by the bound that made it (``vllm:admission_rejections_total``,
label ``reason``: engine/metrics.py), so each level with admission bounds also records the server's count, read from
``/metrics`` before and after it (``trial/measure.py``: the level's ``server_metrics``), and the two are compared:

- **Read straight from vLLM's ``/metrics``**, the counts must match: vLLM counts a refusal before it answers it, and
  the level's closing read comes after the client has every answer. A client that counted 503s the server did not
  refuse got them from another layer (a proxy, Ray Serve's own back-pressure), or from vLLM for another reason.
- **Through Ray Serve** (a deployment's replicas, read through Ray's metrics agents: serve/metrics.py, summed over the
  replicas), the closing read waits only until the agents count the level's finished requests, so refusals the
  client got after the last admitted request ended may not be exported yet: the server's count may fall short by
  as many. A replica whose counter never counted exports none (Ray's agents export a counter once it counts): read
  as none refused.
- Either way the server may count more than the client saw by the requests the client stopped reading before their
  answer (its timeouts and dropped streams).

A disagreement beyond that is said in the scenario's reason; the verdict stays the client's (what a user sees).
Where the server's metrics could not be read, the count is "not read", with why. Pure; the scenarios pass each
level's ``server_metrics`` and requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.engine.metrics import ADMISSION_REASONS, refused_text, rejections
from servetune.load.client import DROPPED, TIMEOUT_FIRST_TOKEN, TIMEOUT_IDLE, TIMEOUT_TOTAL
from servetune.metrics import RequestRecord
from servetune.verify.admitted import refused

#: The client's errors for requests it stopped reading before their answer: the server may have refused them unseen.
UNREAD = (TIMEOUT_FIRST_TOKEN, TIMEOUT_IDLE, TIMEOUT_TOTAL, DROPPED)


@dataclass(frozen=True)
class ServerRefusals:
    """One level's refusals: the client's 503s, the server's count by reason (None: not read, ``why``), and how far
    apart the two may be from timing alone (``short``: the server's count may lag by that many; ``extra``: it may
    count that many the client did not read)."""

    client: int
    by_reason: dict[str, int] | None
    why: str = ""
    short: int = 0
    extra: int = 0

    @property
    def server(self) -> int | None:
        return None if self.by_reason is None else sum(self.by_reason.values())

    @property
    def agrees(self) -> bool | None:
        """Whether the two counts agree within what timing allows (None: the server's was not read)."""
        if self.server is None:
            return None
        return -self.short <= self.server - self.client <= self.extra

    def disagreement(self) -> str:
        """Why the counts disagree, in words ("" where they agree or the server's was not read)."""
        if self.agrees is not False or self.server is None:
            return ""
        if self.client > self.server:
            return (f"the client counted {self.client} 503s, {self.client - self.server} more than vLLM refused: those "
                    "came from another layer (a proxy, Ray Serve) or from vLLM for another reason")  # fmt: skip
        return (
            f"vLLM refused {self.server - self.client} more than the {self.client} 503s the client counted "
            f"(beyond the {self.extra} requests it stopped reading): a layer between them answered otherwise"
        )

    def numbers(self, prefix: str = "") -> dict[str, Any]:
        """verify.json's numbers (``prefix``: the phase's, where a scenario has more than one)."""
        out: dict[str, Any] = {
            f"{prefix}server_refused": self.server, f"{prefix}server_refused_by_reason": self.by_reason,
            f"{prefix}client_503": self.client, f"{prefix}refusals_agree": self.agrees,
        }  # fmt: skip
        if note := (self.disagreement() or (f"not read: {self.why}" if self.by_reason is None else "")):
            out[f"{prefix}server_refused_note"] = note
        return out

    def text(self) -> str:
        """The evidence: ``vLLM's own count: refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs``,
        and whether the client's agrees."""
        if self.by_reason is None:
            return f"vLLM's own count of refusals not read: {self.why}"
        head = f"vLLM's own count: {refused_text(self.by_reason)}"
        if self.agrees:
            return head + f" (the client's 503s: {self.client}, in agreement)"
        return head + f"; it disagrees with the client's: {self.disagreement()}"


def server_refusals(records: Sequence[RequestRecord], server_metrics: Mapping[str, float],
                    lagging: bool = False) -> ServerRefusals:  # fmt: skip
    """The cross-check for one level: its requests (every one sent, warm-up too: the server counts them all) and its
    ``server_metrics`` (trial/measure.py: the change in vLLM's counters over the level; empty where either read
    failed). ``lagging``: read through Ray's metrics agents (a Serve deployment), whose closing read may miss the
    refusals answered after the last admitted request ended."""
    client = sum(refused(r) for r in records)
    extra = sum(r.error_kind in UNREAD for r in records)
    if not server_metrics:
        why = ("Ray's metrics agents gave no reading of the deployment's replicas around the level" if lagging
               else "vLLM's /metrics did not answer before or after the level")  # fmt: skip
        return ServerRefusals(client, None, why, extra=extra)
    by_reason = rejections(server_metrics)
    if not by_reason:
        if not lagging:  # vLLM writes both reasons from its start: a server without them has no such counter
            return ServerRefusals(client, None, "vLLM's /metrics has no vllm:admission_rejections (vLLM before 0.32)",
                                  extra=extra)  # fmt: skip
        by_reason = dict.fromkeys(ADMISSION_REASONS, 0)  # a replica's counter is exported once it counts
    short = 0
    if lagging:
        ends = [r.end for r in records if r.ok and r.end is not None]
        last = max(ends, default=float("-inf"))
        short = sum(refused(r) and (r.end if r.end is not None else r.sent) > last for r in records)
    return ServerRefusals(client, by_reason, short=short, extra=extra)
