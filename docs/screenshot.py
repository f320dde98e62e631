"""Regenerate docs/images/report-front.png: the report's front page, from the stored demo study.

The study in tests/data/cpu-tiny-study (a real `make demo` run) is copied to where `make demo`
keeps its study, `servetune report` writes its report there, and headless Chromium takes a
picture of the top of report.html, as a reader first sees it. Needs /usr/bin/chromium
(`apt-get install -y chromium`, as .ci/run does); takes a few seconds.

    .venv/bin/python docs/screenshot.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "tests" / "data" / "cpu-tiny-study"
OUT = ROOT / "docs" / "images" / "report-front.png"
CHROMIUM = Path("/usr/bin/chromium")
WINDOW = (1200, 900)


def main() -> int:
    if not CHROMIUM.exists():
        print(f"needs {CHROMIUM} (apt-get install -y chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="servetune-screenshot-") as tmp:
        work = Path(tmp)
        study = Path(".servetune/studies/cpu-tiny")  # relative: the report's commands read as make demo's
        shutil.copytree(STUDY, work / study)
        subprocess.run([sys.executable, "-m", "servetune", "report", str(study)], cwd=work, check=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                f"--user-data-dir={work / 'profile'}", f"--screenshot={OUT}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                (work / study / "report" / "report.html").as_uri(),
            ],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        if done.returncode != 0 or not OUT.is_file():
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
