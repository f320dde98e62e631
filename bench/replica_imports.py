"""What a Ray Serve LLM replica servetune starts spends importing, and servetune's share of it.

A replica (an LLM replica of a Serve trial, serve-check or verify; the fake engine's in the Serve integration tests)
imports Serve's replica, Ray Serve LLM's ``LLMServer`` and vLLM engine (with them vLLM's OpenAI entrypoints, torch and
transformers), then servetune's core-claim callback (serve/cores.py) and, in the tests, the fake Serve engine;
``--predictive`` adds servetune's replica class (serve/replica.py, which a deployment exported with
``--autoscaling-policy predictive`` runs, after Ray Serve LLM's ``LLMServer`` it subclasses). Each
round is a fresh interpreter that imports those modules in that order: the process's CPU seconds, and the CPU seconds
and the number of servetune's modules that servetune's imports add on top. ``--src`` more than once alternates the
sources (an A/B: main's ``src`` exported beside a branch's); ``--packages N`` also prints the top N packages by import
self time (``-X importtime``, wall time: read it on a quiet host).

    .venv/bin/python -m compileall -q src
    .venv/bin/python bench/replica_imports.py [--rounds 3] [--src DIR ...] [--packages 12] [--predictive]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys

#: A replica's imports, Serve's and Ray Serve LLM's first (as in the replica), then servetune's, timed apart
#: (a ``str.format`` template: ``ray`` and ``ours`` add the predictive replica's modules).
PROBE = """
import sys, time
import ray.serve._private.replica, ray.llm._internal.serve.core.server.llm_server
import ray.llm._internal.serve.engines.vllm.vllm_engine{ray}
start = time.process_time()
import servetune.serve.cores, servetune.testing.serve_engine{ours}
ours = time.process_time() - start
modules = sum(name.split(".")[0] == "servetune" for name in sys.modules)
print(f"{{time.process_time():.2f}} {{ours:.3f}} {{modules}}")
"""


def packages(stderr: str, top: int) -> list[tuple[str, float]]:
    """The ``top`` packages by the self time (s) of their modules in ``-X importtime``'s lines."""
    found: collections.Counter[str] = collections.Counter()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            own, _, name = line[len("import time:") :].split("|")
            found[name.strip().split(".")[0]] += int(own) / 1e6
    return found.most_common(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", help="servetune's source directory (default: this one's src)")
    parser.add_argument("--packages", type=int, default=0, help="print the top N packages by import self time")
    parser.add_argument("--predictive", action="store_true", help="also import the predictive policy's replica class")
    args = parser.parse_args()
    probe = PROBE.format(
        ray=", ray.serve.llm.deployment" if args.predictive else "",
        ours=", servetune.serve.replica" if args.predictive else "",
    )
    sources = args.src or [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")]
    print("round  source  process cpu-s  servetune's imports cpu-s  servetune modules")
    for round_ in range(1, args.rounds + 1):
        for src in sources:
            env = {**os.environ, "PYTHONPATH": src}
            flags = ["-X", "importtime"] if args.packages else []
            done = subprocess.run([sys.executable, *flags, "-c", probe], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"replica_imports: the probe failed with {src}: {done.stderr.strip().splitlines()[-1]}")
            total, ours, modules = done.stdout.split()
            print(f"{round_:5d}  {src}  {total:>13}  {ours:>25}  {modules:>17}")
            for name, seconds in packages(done.stderr, args.packages):
                print(f"         {name:24} {seconds:6.2f} s")


if __name__ == "__main__":
    main()
