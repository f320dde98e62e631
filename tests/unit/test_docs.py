"""The docs site builds with ``mkdocs build --strict`` (a broken link, a missing page, an unknown
marker fail it), and its generated parts hold what the code holds: every argument of every command,
every field of the search space and of result.json, the names a study logs to MLflow.

One build for the module, into a temporary directory: about 5 s on two cores.
"""

import html
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from servetune.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags dropped (a flag or a field is matched as a reader sees it)."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_every_page_is_built_and_no_marker_is_left(site):
    sources = sorted(p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md"))
    for source in sources:
        built = site / source / "index.html" if source.name != "index" else site / source.parent / "index.html"
        assert built.is_file(), source
        assert "<!-- generated:" not in built.read_text(encoding="utf-8"), source
    assert (site / "images" / "report-front.png").is_file()
    assert not list(site.rglob("*.py")), "docs/hooks.py and docs/docgen/ are the build's, not the site's"


def test_each_command_page_lists_every_argument_of_its_command(site):
    commands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    for name, parser in commands.items():
        text = page_text(site, f"commands/{name}")
        parsers = [parser]
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):  # models tiny, workload from-log
                parsers += list(action.choices.values())
        flags = {flag for p in parsers for a in p._actions for flag in a.option_strings if flag not in ("-h", "--help")}
        missing = sorted(flag for flag in flags if flag not in text)
        assert not missing, f"commands/{name}: {missing}"


def test_the_search_space_reference_has_every_field_with_its_default(site):
    from servetune.config.space import SearchSpace

    text = page_text(site, "reference/search-space")
    for model in (SearchSpace, SearchSpace.model_fields["load"].annotation):  # LoadProtocol, wherever it lives
        for field in model.model_fields:
            assert f"{field}" in text, (model.__name__, field)
    assert re.search(r"capacity_tolerance\s*number, > 0, < 1\s*0\.1\s", text)  # type, bounds, default in a row
    assert "8 per client in flight" in text  # a description, from the comment above the field


def test_the_results_reference_has_result_json_and_study_json(site):
    from servetune.results import StudyInfo, TrialResult

    text = page_text(site, "reference/results")
    level = typing.get_args(TrialResult.model_fields["levels"].annotation)[0]  # LevelResult
    for model in (TrialResult, level, StudyInfo):
        for field in model.model_fields:
            assert field in text, (model.__name__, field)


def test_the_mlflow_reference_has_the_names_the_sync_logs(site):
    from servetune.tracking.fields import LIMITED_BY_TAG
    from servetune.tracking.view import RECOMMENDED_TAG
    from servetune.tracking.writer import ROLE_TAG, TRIAL_TAG

    text = page_text(site, "reference/mlflow")
    for name in (ROLE_TAG, TRIAL_TAG, RECOMMENDED_TAG, "by_level/goodput", "ttft_ms_p99", "max_num_seqs",
                 "record.performance", "trials_meeting_slo", "stability.oom", "record.md", LIMITED_BY_TAG):  # fmt: skip
        assert name in text, name


def test_the_search_space_reference_shows_each_shipped_price_and_how_it_was_derived(site):
    from servetune.capacity.prices import PRICE_LIST_FILES, load_price_table

    text = page_text(site, "reference/search-space")
    for name, file in PRICE_LIST_FILES.items():  # every list, each under its name, as the space picks it
        assert file in text, name
        for gpu, price in load_price_table(name).items():
            d = price.derivation
            assert f"{d.offer}: ${d.listed_usd:g} per {d.per} / {d.gpus} GPU" in text, (name, gpu)
            assert price.source in text and price.provider in text, (name, gpu)
