"""A level where the load client fell behind is marked ``client_bound`` (load/pace.py) and takes no SLO verdict:
the rule on synthetic records and CPU samples, the open loop's schedule that feeds it, and every verdict that
passes over such a level (the capacity search, the trial's best level, the report's fronts and trial table)."""

from __future__ import annotations

import asyncio
import time

from servetune.config.slo import Slo
from servetune.load.pace import CPU_SHARE_BOUND, SEND_LAG_BOUND_MS, ClientPace, client_bound, client_pace, send_lags_ms
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level
from servetune.metrics import RequestRecord
from servetune.report import build_report, gather_points, load_study, render_markdown
from servetune.report.labels import trial_cells
from servetune.report.points import trial_points
from servetune.report.trials import trial_rows
from servetune.results import LevelResult, best_level
from servetune.trial.capacity import CapacitySearch, verdict
from tests.builders import level, study_info, trial, write_study

SLO = Slo.parse("ttft_ms.p99=2000")
BEHIND = "requests sent 180 ms late at the median (bound 50 ms)"


def sent(index: int, scheduled: float | None, lag_s: float, warmup: bool = False) -> RequestRecord:
    at = (scheduled or 0.0) + lag_s
    return RequestRecord(index=index, sent=at, input_tokens=8, max_tokens=8, warmup=warmup, scheduled=scheduled)


def test_an_open_loop_sending_late_past_the_bound_is_client_bound_and_a_few_late_sends_are_not():
    bound_s = SEND_LAG_BOUND_MS / 1e3
    on_time = [sent(i, i * 0.1, bound_s / 4) for i in range(100)]
    pace = client_pace(on_time, cpu_s=1.0, wall_s=10.0)
    assert pace.send_lag_ms_p50 < SEND_LAG_BOUND_MS and client_bound(pace) is None
    # A few sends held up by the host's scheduler: the tail is past the bound, the median is not.
    hiccups = on_time[:95] + [sent(i, i * 0.1, 4 * bound_s) for i in range(95, 100)]
    pace = client_pace(hiccups, cpu_s=1.0, wall_s=10.0)
    assert pace.send_lag_ms_p99 > SEND_LAG_BOUND_MS and client_bound(pace) is None
    # A client falling further behind with every send (its schedule is absolute): the median is past the bound.
    behind = [sent(i, i * 0.1, i * bound_s / 20) for i in range(100)]
    pace = client_pace(behind, cpu_s=1.0, wall_s=10.0)
    assert pace.send_lag_ms_p50 > SEND_LAG_BOUND_MS
    assert client_bound(pace).startswith("requests sent") and f"bound {SEND_LAG_BOUND_MS:g} ms" in client_bound(pace)


def test_warmup_and_closed_loop_requests_have_no_send_lag_and_an_early_send_is_not_negative():
    records = [sent(0, 0.0, 1.0, warmup=True), sent(1, None, 5.0), sent(2, 2.0, -0.5)]
    assert send_lags_ms(records) == [0.0]
    assert client_pace([sent(1, None, 5.0)], cpu_s=None, wall_s=None) == ClientPace(None, None, None)


def test_a_client_process_near_a_full_core_is_client_bound():
    wall = 20.0
    under = client_pace([], cpu_s=wall * (CPU_SHARE_BOUND - 0.1), wall_s=wall)
    assert client_bound(under) is None
    saturated = client_pace([], cpu_s=wall * CPU_SHARE_BOUND, wall_s=wall)
    assert saturated.cpu_share == CPU_SHARE_BOUND
    assert "of a core" in client_bound(saturated)
    both = ClientPace(cpu_share=0.99, send_lag_ms_p50=SEND_LAG_BOUND_MS * 3, send_lag_ms_p99=SEND_LAG_BOUND_MS * 5)
    assert client_bound(both).count("bound") == 2  # both reasons, each with its bound


class _Client:
    """Stands in for StreamingClient: records its send time, then holds the event loop (``block_s``, as a client
    parsing too many chunks does) or waits without holding it (``wait_s``, as a stream does)."""

    def __init__(self, block_s: float = 0.0, wait_s: float = 0.0) -> None:
        self.block_s, self.wait_s = block_s, wait_s

    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> RequestRecord:
        record.sent = time.perf_counter() - t0
        time.sleep(self.block_s)
        await asyncio.sleep(self.wait_s)
        record.end, record.ok = time.perf_counter() - t0, True
        return record


def specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(i, "x", 1, 1, "c") for i in range(n)]


def test_an_open_loop_whose_event_loop_is_held_sends_late_and_is_client_bound():
    # 100 req/s: a request every 10 ms on average; each send holds the loop 3 bounds' worth.
    block = 3 * SEND_LAG_BOUND_MS / 1e3
    records = asyncio.run(run_level(_Client(block_s=block), specs(12), Level("rate", 100.0, "poisson"),  # type: ignore[arg-type]
                                    num_requests=12))  # fmt: skip
    assert all(r.scheduled is not None for r in records)
    pace = client_pace(records, cpu_s=None, wall_s=None)
    assert pace.send_lag_ms_p50 > SEND_LAG_BOUND_MS and client_bound(pace) is not None
    closed = asyncio.run(run_level(_Client(), specs(4), Level("concurrency", 2), num_requests=4))  # type: ignore[arg-type]
    assert all(r.scheduled is None for r in closed)  # a closed loop has no schedule to fall behind


def test_a_request_held_by_the_cap_on_requests_in_flight_is_not_late_by_the_client():
    # 1000 req/s capped at one in flight, each answered after 3 bounds: the 8th waits ~7 answers for the cap,
    # which is the cap working, not the client falling behind.
    wait = 3 * SEND_LAG_BOUND_MS / 1e3
    level_ = Level("rate", 1000.0, "poisson", max_concurrency=1)
    records = asyncio.run(run_level(_Client(wait_s=wait), specs(8), level_, num_requests=8))  # type: ignore[arg-type]
    assert records[-1].sent > 6 * wait  # it did wait for the cap
    assert max(send_lags_ms(records)) < 6 * wait * 1e3  # and that wait is not counted as lag


def client_bound_level(load: float, out_tps: float, ttft_p99: float) -> LevelResult:
    return level(load, out_tps, ttft_p99).model_copy(update={"client_bound": BEHIND})


def test_a_client_bound_verdict_is_unsettled_and_the_capacity_search_counts_it_as_breaking_without_a_repeat():
    made = client_bound_level(16, 1600, 500)
    judged = verdict(Level("concurrency", 16), made, SLO)
    assert judged.meets and not judged.settled and judged.client_bound  # far inside the SLO, still no verdict

    def measure(lv: Level) -> LevelResult:  # the client falls behind from 16 clients on; the SLO is met everywhere
        made = level(lv.value, 100 * lv.value, 300)
        return made.model_copy(update={"client_bound": BEHIND}) if lv.value >= 16 else made

    found = CapacitySearch([Level("concurrency", c) for c in (2, 8, 32)], SLO, budget=4)
    steps, measured = found.steps(), []
    lv = next(steps)
    try:
        while True:
            measured.append(lv.value)
            lv = steps.send(measure(lv))
    except StopIteration:
        pass
    capacity = found.capacity
    assert measured.count(16) == 1  # not measured again: the same client would fall behind again
    assert capacity.value < 16 and 16 in capacity.unsettled and 32 in capacity.unsettled


def test_a_client_bound_level_is_never_the_best_level_nor_eligible_nor_a_point_meeting_the_slo():
    t = trial("t", {"max_num_seqs": 32}, [level(8, 400, 300), client_bound_level(16, 900, 400)])
    assert best_level(t) == 0  # 16 had more goodput and met the SLO, but the client fell behind there
    ops = t.operating_points()
    assert [op.meets_slo for op in ops] == [True, False]
    points = trial_points(t)
    assert points[1].meets_slo and points[1].client_bound == BEHIND and not points[1].eligible
    assert points[0].eligible


def test_the_report_trial_table_says_where_the_client_fell_behind(tmp_path):
    t = trial("t", {"max_num_seqs": 32}, [level(8, 400, 300), client_bound_level(16, 900, 400)])
    rows = trial_rows([t], gather_points([t]))
    assert rows[0].client_bound == (f"concurrency 16: {BEHIND}",)
    assert "client fell behind at 1 level: no verdict" in trial_cells(rows[0])[3]
    md = render_markdown(build_report(load_study(write_study(tmp_path / "s", study_info(), [t]))))
    assert f"### Load client fell behind\n\n- trial t, concurrency 16: {BEHIND}" in md
    kept = trial("k", {"max_num_seqs": 32}, [level(8, 400, 300)])
    assert "Load client fell behind" not in render_markdown(
        build_report(load_study(write_study(tmp_path / "k", study_info(), [kept])))
    )
