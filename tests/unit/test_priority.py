"""A trial undoes Ray's worker niceness, so the engine and the load client it starts run at 0."""

import os
import subprocess
import sys
import threading

import pytest

from servetune.environment import collect_environment
from servetune.study.driver import normal_priority

PRINT_NICENESS = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root or CAP_SYS_NICE")
def test_a_trial_thread_at_ray_s_niceness_comes_back_to_0_and_its_children_with_it():
    seen = {}

    def trial_thread():
        os.setpriority(os.PRIO_PROCESS, 0, 15)  # what Ray gives its workers (per thread on Linux)
        seen["before"] = int(subprocess.check_output([sys.executable, "-c", PRINT_NICENESS]))
        seen["now"] = normal_priority()
        seen["engine"] = int(subprocess.check_output([sys.executable, "-c", PRINT_NICENESS]))
        seen["recorded"] = collect_environment("cpu")["niceness"]

    thread = threading.Thread(target=trial_thread)
    thread.start()
    thread.join()
    assert seen == {"before": 15, "now": 0, "engine": 0, "recorded": "0"}
