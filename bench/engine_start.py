"""What one real vLLM engine start costs on this host, process by process: the unit the end-to-end tier pays for.

A start of ``vllm serve`` on the tiny model (engine/server.py's ``VllmServer``, the tests' engine arguments) until
``/health`` answers. Meanwhile each process of its group is sampled: the API server, the engine core and its worker
(vLLM's CPU build spawns both and always runs the multiprocess executor, so each of the three imports vLLM, torch and
transformers on its own). Prints per round the wall time to ready and each role's CPU seconds (user + system), then
the engine's own "init engine ... took" figure from its log, which is all the start does beyond starting processes.

    .venv/bin/python bench/engine_start.py [--rounds 2] [--env KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
from pathlib import Path

import psutil

from servetune.engine.server import VllmServer
from servetune.models.tiny import build_tiny_model

ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 1024, "dtype": "bfloat16"}
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def role(process: psutil.Process) -> str:
    """A process of the engine's group by what it runs: vLLM titles its engine core and workers."""
    name = " ".join(process.cmdline())
    for title in ("EngineCore", "Worker"):
        if f"VLLM::{title}" in name:
            return title
    return "resource tracker" if "resource_tracker" in name else "API server"


def sample(server: VllmServer, done: threading.Event, seen: dict[int, tuple[str, float]]) -> None:
    """Each process's latest CPU seconds, by pid, until ``done``: a process that ends keeps its last sample."""
    while not done.wait(0.25):
        if server.process is None:
            continue
        try:
            root = psutil.Process(server.process.pid)
            group = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in group:
            try:
                times = process.cpu_times()
                seen[process.pid] = (role(process), times.user + times.system)
            except psutil.NoSuchProcess:
                pass


def one_start(model: Path, env: dict[str, str], log: Path) -> tuple[float, dict[str, float], float | None]:
    seen: dict[int, tuple[str, float]] = {}
    done = threading.Event()
    server = VllmServer(model, ENGINE_ARGS, {"VLLM_CPU_KVCACHE_SPACE": "1", **env}, log_path=log)
    sampler = threading.Thread(target=sample, args=(server, done, seen), daemon=True)
    started = time.monotonic()
    sampler.start()
    with server:
        wall = time.monotonic() - started
        time.sleep(0.5)  # one more sample of every process at ready
        done.set()
        sampler.join()
    by_role: dict[str, float] = {}
    for name, cpu in seen.values():
        by_role[name] = by_role.get(name, 0.0) + cpu
    found = INIT.search(log.read_text(errors="replace"))
    return wall, by_role, float(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the engine, more than once")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        roles = ("API server", "EngineCore", "Worker")
        print(
            f"{'round':>5} {'ready s':>8} " + " ".join(f"{r + ' CPU s':>15}" for r in roles) + f" {'total':>7} init s"
        )
        for n in range(args.rounds):
            wall, by_role, init = one_start(model, env, Path(tmp) / f"engine-{n}.log")
            cells = " ".join(f"{by_role.get(r, 0.0):>15.1f}" for r in roles)
            print(f"{n + 1:>5} {wall:>8.1f} {cells} {sum(by_role.values()):>7.1f} {init if init is not None else '-'}")


if __name__ == "__main__":
    main()
