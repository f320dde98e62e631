"""The shipped trials/ files are found from a checkout and from an installed wheel."""

import subprocess
import sys
import zipfile

from servetune.shipped import CHECKOUT_TRIALS, trials_dir


def test_a_checkout_uses_its_own_trials_dir():
    assert trials_dir() == CHECKOUT_TRIALS and (CHECKOUT_TRIALS / "workloads" / "chat.yaml").is_file()


def test_an_installed_copy_is_found_under_the_prefix(tmp_path):
    installed = tmp_path / "venv" / "share" / "servetune" / "trials"
    (installed / "workloads").mkdir(parents=True)
    assert trials_dir(tmp_path / "no-checkout", prefixes=(str(tmp_path / "venv"),)) == installed
    assert trials_dir(tmp_path / "no-checkout", prefixes=(str(tmp_path / "elsewhere"),)) == tmp_path / "no-checkout"


def test_the_wheel_carries_every_workload_and_the_record_template(tmp_path):
    root = CHECKOUT_TRIALS.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path), str(root)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("servetune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.split("/data/share/servetune/", 1)[1] for n in names if "/data/share/servetune/" in n}
    expected = {f"trials/workloads/{p.name}" for p in (CHECKOUT_TRIALS / "workloads").glob("*.yaml")}
    assert expected and expected | {"trials/record_template.md"} <= shipped
