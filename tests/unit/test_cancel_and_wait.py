"""Stopping a background task of ours must never swallow a cancellation of the caller (SIGTERM cancels the
measuring coroutine; verify/run.py), and must wait until the task has ended."""

import asyncio

import pytest

from servetune.load.runner import cancel_and_wait


async def slow_to_stop(ended: list[str]) -> None:
    """A sampler that takes a while to wind down once cancelled (a metrics read in flight)."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0.3)
        ended.append("ended")
        raise


def test_the_tasks_own_cancellation_is_absorbed_after_it_ended():
    async def main() -> list[str]:
        ended: list[str] = []
        task = asyncio.ensure_future(slow_to_stop(ended))
        await asyncio.sleep(0.01)
        await cancel_and_wait(task)
        assert task.cancelled()
        return ended

    assert asyncio.run(main()) == ["ended"]


def test_a_cancellation_of_the_caller_while_it_waits_goes_through():
    after: list[str] = []

    async def caller(ended: list[str]) -> None:
        task = asyncio.ensure_future(slow_to_stop(ended))
        await asyncio.sleep(0.01)
        await cancel_and_wait(task)  # the caller is cancelled in here (SIGTERM during a Trace's exit)
        after.append("went on to the next scenario")

    async def main() -> list[str]:
        ended: list[str] = []
        outer = asyncio.ensure_future(caller(ended))
        await asyncio.sleep(0.1)  # inside cancel_and_wait, the task winding down
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        return ended

    asyncio.run(main())
    assert after == []


def test_a_task_that_had_failed_before_it_was_stopped_raises_its_error():
    async def fails() -> None:
        raise ValueError("the metrics source broke")

    async def main() -> None:
        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0.01)
        await cancel_and_wait(task)

    with pytest.raises(ValueError, match="metrics source broke"):
        asyncio.run(main())
