"""Trace verify's overload on the real vLLM CPU build: where a 503 spends its time, and what the engine does.

Starts the stored ``make demo`` study's recommendation as ``servetune verify`` starts it (``verify.choose.select``:
export's admission bounds in its engine arguments, unless ``--no-admission``), then runs the given phases one after
the other on it, each a level as verify runs it (``trial.measure.measure_level``):

- ``cN``: a closed loop of N clients, ``rX``: Poisson arrivals at X req/s (``--seconds`` each).

While they run a thread samples, every 0.2 s, vLLM's ``/metrics`` (running, waiting, KV use, preemptions, admission
rejections) and the CPU seconds of each process: this one (the load client), vLLM's API server, its engine core(s),
with the core each last ran on. The client runs where verify runs it: on the cores the engine's ranks are not bound to
(``verify.run.client_pin``; ``--no-pin`` leaves it where it is). Per phase it prints what was sent, completed and refused (503 before the stream or
inside it), the refusals' answer times, the admitted requests' TTFT, and those samples summed; ``--json`` keeps it
all. Run it under the heavy lock::

    flock /tmp/servetune-heavy.lock python bench/overload_trace.py c6 c8 r44 r15 [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
import psutil

from servetune.engine.cores import ClientCores, client_record, pinned_to
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.load.tokenizer import load_tokenizer
from servetune.trial.measure import LevelPlan, measure_level
from servetune.verify.choose import select
from servetune.verify.run import client_pin, started

STUDY = Path(__file__).resolve().parent.parent / "tests" / "data" / "cpu-tiny-study"
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv": "vllm:kv_cache_usage_perc",
    "preemptions": "vllm:num_preemptions_total",
    "rejected": "vllm:admission_rejections_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def scrape(url: str) -> dict[str, float]:
    """The gauges and counters of :data:`GAUGES`, summed over their labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in GAUGES.items():
            if re.match(re.escape(name) + r"[{ ]", line):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def processes(server_pid: int) -> dict[str, psutil.Process]:
    """This process (the client), and under the engine's reaper the API server and the engine core(s), by role."""
    found = {"client": psutil.Process()}
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            name, cmd = child.name(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "--guard" in cmd:
            continue
        role = "engine" if "EngineCore" in name or "EngineCore" in cmd else "api" if "serve" in cmd else name
        found[role if role not in found else f"{role}-{child.pid}"] = child
    return found


class Sampler(threading.Thread):
    def __init__(self, url: str, procs: dict[str, psutil.Process], every_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.procs, self.every_s = url, procs, every_s
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sample: dict = {"t": time.perf_counter(), "load1": os.getloadavg()[0]}
            try:
                sample.update(scrape(self.url))
            except OSError as exc:
                sample["scrape_error"] = str(exc)
            for role, proc in self.procs.items():
                try:
                    with proc.oneshot():
                        times = proc.cpu_times()
                        sample[f"cpu.{role}"] = times.user + times.system
                        sample[f"core.{role}"] = proc.cpu_num()
                        sample[f"threads.{role}"] = proc.num_threads()
                except psutil.Error:
                    pass
            self.samples.append(sample)
            self.done.wait(self.every_s)


def p(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 1) if values else None


def phase_summary(name: str, records: list, samples: list[dict], t_from: float, t_to: float) -> dict:
    over = [r for r in records if not r.warmup]
    refused = [r for r in over if r.error and str(r.error).startswith("HTTP 503")]
    in_stream = [r for r in refused if "(in the stream)" in str(r.error)]
    ok = [r for r in over if r.ok]
    lags = [r.sent - r.scheduled for r in over if r.scheduled is not None]
    window = [s for s in samples if t_from <= s["t"] <= t_to]
    out: dict = {
        "phase": name, "sent": len(over), "ok": len(ok), "refused": len(refused), "refused_in_stream": len(in_stream),
        "other_errors": sorted({str(r.error_kind) for r in over if not r.ok and r not in refused}),
        "refuse_ms_p50": p([r.e2el_s for r in refused], 50), "refuse_ms_p99": p([r.e2el_s for r in refused], 99),
        "refuse_pre_stream_ms_p99": p([r.e2el_s for r in refused if r not in in_stream], 99),
        "refuse_in_stream_ms_p99": p([r.e2el_s for r in in_stream], 99),
        "ttft_ms_p50": p([r.ttft_s for r in ok], 50), "ttft_ms_p99": p([r.ttft_s for r in ok], 99),
        "send_lag_ms_p99": p(lags, 99), "ok_per_s": round(len(ok) / (t_to - t_from), 1),
    }  # fmt: skip
    if len(window) >= 2:
        first, last = window[0], window[-1]
        wall = last["t"] - first["t"]
        for key in ("running", "waiting", "kv"):
            vals = [s[key] for s in window if key in s]
            out[f"{key}_max"] = max(vals) if vals else None
            out[f"{key}_mean"] = round(sum(vals) / len(vals), 2) if vals else None
        for key in ("preemptions", "rejected", "prompt_tokens"):
            if key in first and key in last:
                out[f"{key}_delta"] = last[key] - first[key]
        for key in first:
            if key.startswith("cpu.") and key in last:
                out[f"cores_{key[4:]}"] = round((last[key] - first[key]) / wall, 2)  # cores busy on average
            if key.startswith("core."):
                out[f"ran_on_{key[5:]}"] = sorted({s[key] for s in window if key in s})
        out["load1"] = round(sum(s["load1"] for s in window) / len(window), 2)
    return out


class LoopWatch:
    """The event loop's stalls: a task ticks every 10 ms and notes each tick late by over 50 ms; a thread notes the main
    thread's stack whenever the loop has not ticked for 0.3 s (once per stall)."""

    def __init__(self) -> None:
        self.beat = time.perf_counter()
        self.stalls: list[dict] = []
        self.stacks: list[dict] = []
        self.main = threading.get_ident()
        self.done = threading.Event()

    async def tick(self) -> None:
        while not self.done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            self.beat = now = time.perf_counter()
            if now - before > 0.06:
                self.stalls.append({"t": before, "late_s": round(now - before - 0.01, 3)})

    def watch(self) -> None:
        noted = 0.0
        while not self.done.wait(0.05):
            if time.perf_counter() - self.beat > 0.3 and self.beat != noted:
                noted = self.beat
                frame = sys._current_frames().get(self.main)
                self.stacks.append({"t": time.perf_counter(), "stack": traceback.format_stack(frame)[-8:]})


async def run_phases(server, chosen, prompts, phases: list[str], seconds: float, sampler: Sampler,
                     loop_watch: LoopWatch) -> list[dict]:  # fmt: skip
    ticker = asyncio.ensure_future(loop_watch.tick())
    spec = chosen.spec
    served = spec.engine_args.get("served_model_name") or spec.model
    results = []
    async with StreamingClient(server.url, served, api=spec.workload.api, timeout_s=60, first_token_timeout_s=30,
                               idle_timeout_s=10, ignore_eos=spec.workload.ignore_eos,
                               temperature=spec.workload.temperature) as client:  # fmt: skip
        for i, name in enumerate(phases):
            kind = "concurrency" if name[0] == "c" else "rate"
            level = Level(kind, float(name[1:]), "poisson" if kind == "rate" else None)
            plan = LevelPlan(level, num_requests=None, duration_s=seconds, warmup_requests=0)
            t_from = time.perf_counter()
            _, records = await measure_level(client, server.url, spec.workload, prompts, plan, stream=40_000 + i,
                                             slo=spec.slo)  # fmt: skip
            t_to = time.perf_counter()
            summary = phase_summary(name, records, sampler.samples, t_from, t_to)
            stalls = [x for x in loop_watch.stalls if t_from <= x["t"] <= t_to]
            summary["loop_stalls"] = len(stalls)
            summary["loop_stall_max_s"] = max((x["late_s"] for x in stalls), default=0.0)
            summary["t_from"] = t_from
            summary["records"] = [
                {"sent": r.sent, "scheduled": r.scheduled, "ttft": r.ttft_s, "e2el": r.e2el_s, "error": r.error}
                for r in records
            ]
            results.append(summary)
            print(json.dumps({k: v for k, v in summary.items() if k != "records"}), flush=True)
            await asyncio.sleep(1.0)
    loop_watch.done.set()
    await ticker
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phases", nargs="+", help="cN (closed loop, N clients) or rX (Poisson, X req/s)")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--no-admission", action="store_true", help="start the engine without export's bounds")
    parser.add_argument("--no-pin", action="store_true", help="leave the client where it is (verify pins it to the "
                        "cores the engine's ranks are not bound to: verify/run.py client_pin)")  # fmt: skip
    parser.add_argument("--study", type=Path, default=STUDY)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--py-spy", type=Path, metavar="DIR", help="record the client's, API server's and engine "
                        "core's stacks with py-spy into DIR (ROLE.txt, py-spy's raw format)")  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overload-trace-"))
    try:
        study = work / "study"
        shutil.copytree(args.study, study)
        selection = select(study, "best", sys.executable, None, admission=not args.no_admission)
        chosen = selection.winner
        print(f"trial {chosen.trial_id}: engine args {chosen.spec.engine_args}, env {chosen.spec.env}", flush=True)
        prompts = PromptFactory(load_tokenizer(chosen.spec.tokenizer))
        log = work / "verify" / chosen.trial_id / "engine.log"
        log.parent.mkdir(parents=True)
        with started(chosen, log) as server:
            procs = processes(server.process.pid)
            pin = ClientCores([], "--no-pin") if args.no_pin else client_pin(server)
            print(f"processes: { {k: v.pid for k, v in procs.items()} }, binding {server.cpu_binding}, "
                  f"client {client_record(pin)}", flush=True)  # fmt: skip
            sampler = Sampler(server.url, procs)
            sampler.start()
            loop_watch = LoopWatch()
            watcher = threading.Thread(target=loop_watch.watch, daemon=True)
            watcher.start()
            spies = []
            if args.py_spy:  # every Python process's stacks, idle ones too, without stopping them
                for role in [r for r in ("client", "api", "engine", "VLLM::Worker") if r in procs]:
                    out = args.py_spy / f"{role.replace('::', '-')}.txt"
                    spies.append(subprocess.Popen(
                        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(procs[role].pid),
                         "--idle", "--nonblocking", "--rate", "50", "--format", "raw", "--output", str(out),
                         "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            try:
                with pinned_to(pin.cores):  # the sampler and watcher threads too, as verify's own would be
                    results = asyncio.run(run_phases(server, chosen, prompts, args.phases, args.seconds, sampler,
                                                     loop_watch))  # fmt: skip
            finally:
                sampler.done.set()
                loop_watch.done.set()
                sampler.join()
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=30)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "client": client_record(pin),
                        "phases": results,
                        "samples": sampler.samples,
                        "loop_stalls": loop_watch.stalls,
                        "stacks": loop_watch.stacks,
                    },
                    indent=1,
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
