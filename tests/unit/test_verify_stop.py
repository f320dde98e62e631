"""A stopped verification stops even where the cancellation was absorbed below (verify/run.py)."""

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from servetune.verify.run import _winner


def test_a_cancellation_absorbed_in_a_scenario_still_stops_the_next_one_from_starting():
    started = []
    progress = SimpleNamespace(step=lambda name, seconds=None: started.append(name))
    target = SimpleNamespace(
        engine=None, admission_bound=False, budget=SimpleNamespace(soak_s=1.0, scenario_s=1.0, repeats=1, repeat_s=1.0)
    )

    async def main():
        task = asyncio.current_task()
        task.cancel()  # Ctrl-C's or SIGTERM's cancellation ...
        with contextlib.suppress(asyncio.CancelledError):  # ... absorbed where a level's requests were ending
            await asyncio.sleep(1)
        await _winner(target, progress)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    assert started == []  # no scenario began after the stop
