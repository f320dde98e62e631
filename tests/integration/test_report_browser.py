"""The HTML report renders in a real browser, offline: headless Chromium takes a screenshot.

Needs Chromium at /usr/bin/chromium (Debian/Ubuntu: ``apt-get install -y chromium``); skipped
without it. The proof that plotly drew the plot is in the pixels: the Pareto front's colour.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from servetune.report import build_report, load_study
from servetune.report.html import render_html
from servetune.report.labels import FRONT_COLOR, RECOMMENDED_COLOR
from tests.builders import demo_study

CHROMIUM = Path("/usr/bin/chromium")


def pixels_near(image: np.ndarray, hex_color: str, tolerance: float = 0.06) -> int:
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tolerance).sum())


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install -y chromium)")
def test_report_html_renders_the_plot_in_headless_chromium(tmp_path):
    report = build_report(load_study(demo_study(tmp_path / "demo")))
    page = tmp_path / "report.html"
    page.write_text(render_html(report), encoding="utf-8")
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,900",
            page.as_uri(),
        ],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    image = imread(shot)
    assert image.shape[:2] == (900, 1200)
    # The first figure (cost vs P99 TTFT) is in view: the front's line and markers, and the star.
    assert pixels_near(image, FRONT_COLOR) > 500, "no Pareto front drawn: plotly.js did not render"
    assert pixels_near(image, RECOMMENDED_COLOR) > 50, "no recommended star drawn"
