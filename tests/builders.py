"""Made-up studies for tests: levels, trials, study info, and a study directory on disk; the recorded study;
a local OpenAI-style completions server for client-side tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

from aiohttp import web

from servetune.results import LevelResult, StudyInfo, TrialResult
from servetune.summary import LatencyStats, LevelSummary


def stats(p99: float, mean: float | None = None) -> LatencyStats:
    mean = p99 / 2 if mean is None else mean
    return LatencyStats(mean=mean, p50=mean, p90=p99 * 0.9, p95=p99 * 0.95, p99=p99, count=100)


def level(
    concurrency: float, out_tps: float, ttft_p99: float, tpot_p99: float = 40.0, tpot_mean: float = 25.0,
    violations: tuple[str, ...] = (), server: dict[str, float] | None = None,
) -> LevelResult:  # fmt: skip
    summary = LevelSummary(
        level={"concurrency": concurrency}, duration_s=60.0, completed=100, failed=0, warmup_excluded=4,
        errors_by_kind={}, total_input_tokens=20000, total_output_tokens=int(out_tps * 60),
        request_throughput=out_tps / 60, output_throughput=out_tps, input_throughput=out_tps * 3,
        total_token_throughput=out_tps * 4, goodput=out_tps / 60, error_rate=0.0,
        ttft_ms=stats(ttft_p99), tpot_ms=stats(tpot_p99, tpot_mean), itl_ms=stats(tpot_p99),
        e2el_ms=stats(ttft_p99 + 64 * tpot_p99),
    )  # fmt: skip
    return LevelResult(summary=summary, server_metrics=server or {}, slo_violations=list(violations))


def trial(
    trial_id: str, params: dict, levels: list[LevelResult] = (), outcome: str = "COMPLETE", reason: str | None = None,
    devices: int = 1, price: float = 2.0, env: dict[str, str] | None = None, device: str = "gpu",
) -> TrialResult:  # fmt: skip
    return TrialResult(
        trial_id=trial_id, study="demo", params=params,
        engine_args={"enforce_eager": True, "max_model_len": 2048, **params},
        env=env if env is not None else {"VLLM_LOGGING_LEVEL": "INFO"}, model="org/tiny-chat", device=device,
        devices=devices, price_per_device_hour=price, slo=SLO, outcome=outcome, reason=reason, levels=list(levels),
    )  # fmt: skip


SLO = ["ttft_ms_p99 <= 2000", "tpot_ms_p99 <= 100"]


def study_info(**overrides) -> StudyInfo:
    fields = {
        "name": "demo", "created": "2025-01-01T00:00:00Z", "space_file": "space.yaml", "model": "org/tiny-chat",
        "workload": "chat", "device": "gpu", "algorithm": "grid",
        "objectives": [("cost_per_mtok_usd", "min"), ("ttft_ms_p99", "min")], "slo": SLO,
        "price_per_device_hour": 2.0, "servetune_version": "0.1.0",
    }  # fmt: skip
    fields.update(overrides)
    return StudyInfo(**fields)


def write_study(root: Path, info: StudyInfo, trials: list[TrialResult], running: tuple[str, ...] = ()) -> Path:
    (root / "trials").mkdir(parents=True)
    (root / "study.json").write_text(info.model_dump_json(indent=2))
    (root / "space.yaml").write_text("max_num_seqs: [16, 32, 64]\n")
    for t in trials:
        (root / "trials" / t.trial_id).mkdir()
        (root / "trials" / t.trial_id / "result.json").write_text(t.model_dump_json(indent=2))
    for name in running:
        (root / "trials" / name).mkdir()
    return root


def demo_trials() -> list[TrialResult]:
    """max_num_seqs 16 / 32 complete, 64 ran out of memory, one huge config does not fit.

    The cheapest point meeting the SLO is max_num_seqs=32 at concurrency 32; its neighbour 64
    ran out of memory, so the recommendation steps back to max_num_seqs=16 at concurrency 16.
    """
    slow = ("ttft_ms_p99 = 3000 > 2000",)
    return [
        trial("t16", {"max_num_seqs": 16, "gpu_memory_utilization": 0.9},
              [level(8, 400, 300, tpot_p99=25, tpot_mean=15),
               level(16, 700, 600, tpot_p99=35, tpot_mean=20, server={"kv_cache_usage_max": 0.55, "preemptions": 0})]),
        trial("t32", {"max_num_seqs": 32, "gpu_memory_utilization": 0.9},
              [level(16, 800, 500, tpot_p99=30, tpot_mean=18), level(32, 1200, 1500, tpot_p99=50, tpot_mean=28),
               level(64, 1500, 3000, tpot_p99=90, tpot_mean=45, violations=slow)]),
        trial("t64", {"max_num_seqs": 64, "gpu_memory_utilization": 0.9}, outcome="FAILED",
              reason="engine exited with code 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        trial("t256", {"max_num_seqs": 256, "gpu_memory_utilization": 0.95}, outcome="INFEASIBLE",
              reason="does not fit: KV pool would be -3.1 GiB at max_model_len 2048"),
    ]  # fmt: skip


def demo_study(root: Path) -> Path:
    return write_study(root, study_info(), demo_trials(), running=("t-running",))


#: A study recorded on the CPU stand-in (tests/data/cpu-tiny-study): real results, read-only.
RECORDED_STUDY = Path(__file__).parent / "data" / "cpu-tiny-study"


def copy_recorded_study(root: Path) -> Path:
    """A copy of :data:`RECORDED_STUDY` at ``root``, for a test that changes it."""
    shutil.copytree(RECORDED_STUDY, root)
    return root


def edit_result(study: Path, trial_id: str, change: Callable[[dict], object]) -> None:
    """Change a stored trial's ``result.json`` in place: ``change`` is given it as a dict."""
    path = study / "trials" / trial_id / "result.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# --- a local server ----------------------------------------------------------------------------


@asynccontextmanager
async def completions_server(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """A local OpenAI-style server whose ``POST /v1/completions`` is ``handler``, on 127.0.0.1 at a free port;
    yields its URL and stops it on leaving."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def stream_events(request: web.Request, events: Iterable[dict]) -> web.StreamResponse:
    """Answer ``request`` as a streamed completion: each event as a server-sent ``data:`` line, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


# --- tests -----------------------------------------------------------------------------------


def bench_script(name: str) -> ModuleType:
    """A script of ``bench/`` (``gpu_study``, say) imported as a module, for its functions' tests."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
