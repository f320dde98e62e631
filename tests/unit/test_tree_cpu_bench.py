"""bench/tree_cpu.py: a command measured through it runs as it would outside it. The script is the subreaper of the
command's orphans, and one it left a zombie until the command ended still ran for whoever waited on it by process id
(a test's stop of a process tree, ``psutil.wait_procs``, waited out its whole grace period)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TREE_CPU = Path(__file__).resolve().parents[2] / "bench" / "tree_cpu.py"

#: Orphans a ``sleep`` (its shell exits at once), stops it by process id and waits for it to be gone.
COMMAND = """
import subprocess, sys
import psutil
pid = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout
orphan = psutil.Process(int(pid))
orphan.kill()
gone, alive = psutil.wait_procs([orphan], timeout=20)
sys.exit(1 if alive else 0)
"""


def test_an_orphan_the_command_stops_is_reaped_while_the_command_waits_for_it():
    done = subprocess.run([sys.executable, str(TREE_CPU), "--", sys.executable, "-c", COMMAND],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr  # 1: the orphan was still a zombie after 20 s
    assert "tree_cpu: wall" in done.stderr


def test_a_python_c_process_is_told_by_its_first_argument_else_its_codes_first_words():
    spec = importlib.util.spec_from_file_location("tree_cpu", TREE_CPU)
    tree_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree_cpu)
    serve, lm_eval = ["python3", "-c", "from vllm import x", "serve", "m"], ["python3", "-c", "import lm_eval", "run"]
    assert [tree_cpu.kind_of(c, "python3") for c in (serve, lm_eval)] == ["python3 -c serve", "python3 -c run"]
    tracker = ["python3", "-c", "from multiprocessing.resource_tracker import main;main(7)"]
    assert tree_cpu.kind_of(tracker, "python3") == "python3 -c from multiprocessing.resource_tracker import"
    assert tree_cpu.kind_of(["python3", "-m", "pytest", "-c", "x"], "python3") == "pytest"
