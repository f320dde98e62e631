"""A synthetic request log with known traffic, made from a seed (the shipped one and the tests').

Conversations start as a gamma process (``rate`` per second, gaps' coefficient of variation
``cv``); each has 1 to ``max_turns`` turns, a think time (lognormal, median ``think_median_s``)
after each answer, and, as a chat client sends them, later turns whose input counts carry the
conversation so far. A share ``prefix_share`` of first prompts starts with one system prompt.
Token counts are the logging model's; texts are given for first turns only (enough to measure
the shared prefix). ``sessions=False`` makes single requests instead.

    python -m servetune.traffic.synthetic --out trials/logs/synthetic-chat.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

#: 2026-01-01T00:00:00Z: where the synthetic log's clock starts.
EPOCH = 1_767_225_600.0

SYSTEM_PROMPT = (
    "You are a helpful assistant for an online shop. Answer in short paragraphs, cite the order "
    "number when the customer gives one, and never promise a refund without a ticket. "
)
_WORDS = ("order", "parcel", "delivery", "refund", "size", "colour", "invoice", "address", "return", "discount",
          "account", "password", "shipping", "warranty", "receipt", "voucher", "exchange", "tracking")  # fmt: skip


def synthetic_log(requests: int = 400, *, rate: float = 0.5, cv: float = 1.5, max_turns: int = 4, think_median_s: float = 3.0,
                  prefix_share: float = 0.8, sessions: bool = True, seed: int = 0) -> list[dict]:  # fmt: skip
    """About ``requests`` log records (whole conversations), in time order."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    records: list[dict] = []
    start = EPOCH
    conversation = 0
    while len(records) < requests:
        turns = int(rng.integers(1, max_turns + 1)) if sessions else 1
        system = rng.random() < prefix_share
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(8, 30))))
        prompt = (SYSTEM_PROMPT if system else "") + f"Customer {conversation}: {words}?"
        history = 0
        sent = start
        for turn in range(min(turns, requests - len(records))):
            new = int(len(prompt) / 4) if turn == 0 else int(rng.integers(8, 64))
            output = int(rng.integers(16, 64))
            duration = round(0.2 + 0.02 * output, 3)
            record: dict[str, float | str] = {
                "timestamp": round(sent, 3),
                "input_tokens": history + new,
                "output_tokens": output,
                "duration_s": duration,
            }
            if sessions:
                record["session_id"] = f"c{conversation:04d}"
            if turn == 0:
                record["prompt"] = prompt
            records.append(record)
            history += new + output
            sent += duration + float(rng.lognormal(np.log(think_median_s), 0.5))
        conversation += 1
        start += float(rng.gamma(shape, 1.0 / (rate * shape)))
    records.sort(key=lambda r: r["timestamp"])
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the synthetic request log (the same file every time).")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in synthetic_log(args.requests, seed=args.seed)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
