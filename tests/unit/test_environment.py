"""A trial's environment record names the stack of the interpreter that runs its engine (``--python``,
``--vllm-python``: an upgrade candidate), not servetune's own: vLLM, torch, NCCL and Python asked of it in one go."""

from __future__ import annotations

import json
import sys

from servetune.engine.args import engine_stack, vllm_version
from servetune.environment import collect_environment

CANDIDATE = {"vllm": "vllm==0.99.0", "torch": "9.8.7", "nccl": None, "python": "3.99.1"}


def fake_candidate(tmp_path, answer=CANDIDATE):
    """An interpreter that answers any program with ``answer`` and counts how often it was asked."""
    calls = tmp_path / "calls"
    path = tmp_path / "candidate-python"
    path.write_text(f"#!/bin/sh\necho asked >> {calls}\necho '{json.dumps(answer)}'\n")
    path.chmod(0o755)
    return path, calls


def test_the_record_takes_the_engine_interpreter_s_torch_and_python_asked_once(tmp_path):
    python, calls = fake_candidate(tmp_path)
    env = collect_environment("cpu", python=str(python))
    assert (env["vllm"], env["torch"], env["python"], env["nccl"]) == (
        "vllm==0.99.0",
        "9.8.7",
        "3.99.1",
        "not installed",
    )
    assert calls.read_text().splitlines() == ["asked"]  # one subprocess for the whole stack


def test_another_path_to_this_interpreter_answers_as_this_one_does(tmp_path):
    """The program another interpreter runs gives what servetune reads of its own (a shim: another path, no venv)."""
    shim = tmp_path / "shim-python"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    assert engine_stack(str(shim)) == engine_stack() and engine_stack()["python"] == "{}.{}.{}".format(
        *sys.version_info[:3]
    )


def test_an_interpreter_that_cannot_be_asked_is_recorded_as_unknown(tmp_path):
    env = collect_environment("cpu", python=str(tmp_path / "no-such-python"))
    assert (env["vllm"], env["torch"], env["python"]) == ("not installed", "not installed", "unknown")


def test_vllm_s_version_is_asked_of_another_interpreter_the_same_way(tmp_path):
    python, _ = fake_candidate(tmp_path)
    assert vllm_version(str(python)) == "vllm==0.99.0"
    (tmp_path / "bare").mkdir()
    without, _ = fake_candidate(tmp_path / "bare", {**CANDIDATE, "vllm": None})
    assert vllm_version(str(without)) is None
