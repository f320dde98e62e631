"""`make setup` asks for PyTorch's CPU build explicitly (read from `make -n`, nothing installed)."""

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def setup_commands(tmp_path, *overrides: str) -> list[str]:
    venv = tmp_path / "venv"  # not there: make lists every step of the set-up
    done = subprocess.run(["make", "-n", "-B", "setup", f"VENV={venv}", *overrides], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in done.stdout.splitlines() if " -m pip install " in line]


def cpu_extra_torch_pin() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    cpu = tomllib.loads(text)["project"]["optional-dependencies"]["cpu"]
    return next(req for req in cpu if req.startswith("torch"))


def test_torch_comes_first_from_pytorchs_cpu_index_at_the_extras_pin(tmp_path):
    torch_step, project_step = setup_commands(tmp_path)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch_step
    assert torch_step.endswith(f"'{cpu_extra_torch_pin()}'")
    assert "--retries 1" in torch_step  # an unreachable index costs about a second, not 8 s a package
    assert "-e '.[cpu,dev]'" in project_step and "--extra-index-url" not in project_step


def test_the_index_is_a_variable(tmp_path):
    torch_step, _ = setup_commands(tmp_path, "TORCH_INDEX=https://mirror.example/whl/cpu")
    assert "--extra-index-url https://mirror.example/whl/cpu" in torch_step
    torch_step, _ = setup_commands(tmp_path, "TORCH_INDEX=")
    assert "--extra-index-url" not in torch_step and "--retries" not in torch_step
