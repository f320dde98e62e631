"""How far the capacity planner's KV tokens are from what vLLM logged, per public log and per release (issue #39).

Each case of ``tests/unit/test_capacity_calibration.py`` (``KV_CASES``: model, GPU, engine arguments, the vLLM
release that logged it, and its source) is planned twice: with the memory profile of the release that ran it
(what servetune now does, ``capacity/profile.py``) and with vLLM 0.32's (what it did for every version
before). Prints one row per case, then the worst |error| per release and per model architecture (asserted
cases; the last column counts the known misses, whose row names the unmodelled cause). Targets: within 3 % for 0.8 and later,
within 10 % on V0. No GPU, no vLLM: the planner is a pure function.

    PYTHONPATH=src .venv/bin/python bench/plan_accuracy.py            # the table
    PYTHONPATH=src .venv/bin/python bench/plan_accuracy.py --markdown # as bench/README.md shows it
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the cases live with their test

from servetune.capacity import VLLM_0_32  # noqa: E402
from tests.unit.test_capacity_calibration import KV_CASES, KvCase  # noqa: E402

HEADINGS = (
    "vLLM", "case", "architecture", "profile", "logged tokens", "planned", "error", "with 0.32's profile", "target",
)  # fmt: skip


def row(case: KvCase) -> list[str]:
    plan = case.plan()
    logged = case.logged()
    target = "3 %" if case.release >= (0, 8) else "10 %"
    if not case.asserted:
        target = f"not asserted: {case.note}"
    return [
        case.vllm, case.name, case.architecture, plan.settings.profile, f"{logged:,}", f"{plan.kv_cache_tokens:,}",
        f"{case.error():+.1%}", f"{case.error(VLLM_0_32):+.1%}", target,
    ]  # fmt: skip


def worst_by(cases: list[KvCase], key: Callable[[KvCase], str]) -> list[list[str]]:
    """The worst |error| per key (release span, architecture) over the asserted cases, and how many are not."""
    worst: dict[str, tuple[float, float, int, int]] = {}
    for case in cases:
        name = key(case)
        now, before, count, missed = worst.get(name, (0.0, 0.0, 0, 0))
        if not case.asserted:
            worst[name] = (now, before, count, missed + 1)
            continue
        worst[name] = (max(now, abs(case.error())), max(before, abs(case.error(VLLM_0_32))), count + 1, missed)
    return [
        [name, str(n), f"{now:.1%}" if n else "-", f"{before:.1%}" if n else "-", str(missed)]
        for name, (now, before, n, missed) in sorted(worst.items())
    ]


def per_release(cases: list[KvCase]) -> list[list[str]]:
    """The worst |error| per release span (the profile's name), asserted cases only."""
    return worst_by(cases, lambda case: case.plan().settings.profile)


def per_architecture(cases: list[KvCase]) -> list[list[str]]:
    """The worst |error| per model architecture class, asserted cases only."""
    return worst_by(cases, lambda case: case.architecture)


def _print(headings: tuple[str, ...] | list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(headings) + " |")
        print("|" + "|".join("---" for _ in headings) + "|")
        for cells in rows:
            print("| " + " | ".join(cells) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    for cells in [list(headings), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args()
    _print(HEADINGS, [row(case) for case in KV_CASES], args.markdown)
    worst = ("cases", "worst abs error", "worst with 0.32's profile", "not asserted")
    print()
    _print(("profile", *worst), per_release(KV_CASES), args.markdown)
    print()
    _print(("architecture", *worst), per_architecture(KV_CASES), args.markdown)


if __name__ == "__main__":
    main()
