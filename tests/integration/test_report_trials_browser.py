"""The table of all trials and the SLO bounds, as headless Chromium renders the report of a recorded study.

Chromium dumps the DOM after the page's scripts ran (plotly draws its SVG then); the test reads
the table's rows and cells, and the text plotly drew, from that dump. Skipped without Chromium.
"""

from __future__ import annotations

import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from servetune.report import build_report, load_study
from servetune.report.html import render_html
from tests.integration.test_report_browser import CHROMIUM

RECORDED = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


class TableReader(HTMLParser):
    """The headings and rows (``data-trial``, cells) of ``<table id="trials">``, and every SVG text."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.rows: list[tuple[str, list[str]]] = []
        self.svg_text: list[str] = []
        self._in_table = False
        self._cell: list[str] | None = None
        self._in_svg_text = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "table" and found.get("id") == "trials":
            self._in_table = True
        elif self._in_table and tag == "tr" and "data-trial" in found:
            self.rows.append((found["data-trial"] or "", []))
        elif self._in_table and tag in ("td", "th"):
            self._cell = []
        elif tag == "text":
            self._in_svg_text = True
            self.svg_text.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            (self.headings if tag == "th" else self.rows[-1][1]).append(text)
            self._cell = None
        elif tag == "text":
            self._in_svg_text = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_svg_text:
            self.svg_text[-1] += data


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install -y chromium)")
def test_the_rendered_page_has_a_row_per_trial_and_draws_every_ttft_bound(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(build_report(load_study(RECORDED))), encoding="utf-8")
    done = subprocess.run(
        [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    dom = TableReader()
    dom.feed(done.stdout)

    assert dom.headings == [
        "trial", "config (varied parameters)", "outcome", "best level", "capacity at the SLO", "knee", "goodput (req/s)",
        "TTFT P99 (ms)", "TPOT P99 (ms)", "$/Mtok (USD)", "SLO broken (first level)", "stopped because", "conclusion",
        "KV tokens planned / vLLM",
    ]  # fmt: skip
    assert len(dom.rows) == 7 and all(len(cells) == len(dom.headings) for _, cells in dom.rows)
    rows = {trial_id: dict(zip(dom.headings, cells, strict=True)) for trial_id, cells in dom.rows}
    assert dom.rows[0][0] == "e57a166985b8"  # the recommended trial comes first
    base = rows["e57a166985b8"]
    assert base["trial"] == "e57a166985b8 (recommended)" and base["config (varied parameters)"] == "vLLM defaults"
    assert (base["best level"], base["goodput (req/s)"], base["TTFT P99 (ms)"]) == ("concurrency 8", "29.3", "88.7")
    assert base["SLO broken (first level)"] == "concurrency 32: ttft_ms_p95 = 160 > 150"
    assert base["capacity at the SLO"] == "-"  # recorded before trials searched for their capacity
    # Its knee, derived from its levels (2, 8, 32 clients): past 8, throughput grew less than half as fast as the load.
    assert base["knee"].startswith("8 clients at ") and "grew < 50% as fast as the load" in base["knee"]
    assert base["KV tokens planned / vLLM"] == "524,288 / 524,288 (+0.0%)"  # the CPU build's pool, planned exactly
    assert base["conclusion"].startswith("keep: recommended to ship (")
    cheap = rows["18ae6e731937"]
    assert cheap["config (varied parameters)"] == "seqs=32 mbt=4096 chunk=on prefix=on kvGiB=2 dp=1"
    assert cheap["$/Mtok (USD)"] == "0.04175" and cheap["stopped because"] == "SLO broken at concurrency 2"
    assert cheap["conclusion"] == "eliminate: broke the SLO at every load level"

    # plotly drew the P95 bounds on the P99 axes, and the broken points' labels.
    assert "SLO ttft_ms_p95 <= 150 (axis is P99)" in dom.svg_text
    assert "SLO tpot_ms_p95 <= 20 (axis is P99)" in dom.svg_text
    assert "TTFT P95" in dom.svg_text and "USD per million output tokens — lower is better" in dom.svg_text
