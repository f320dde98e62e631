"""mkdocs hook: the parts of the site generated from servetune's own code each time it builds.

A page asks for a generated part with a marker on a line of its own:

``<!-- generated: model servetune.config:SearchSpace -->``
    every field of the model and of each model its fields hold (type, default, bounds,
    description), a section per model (docgen/models.py). The class is found by name in the
    package or any module under it, so the reference follows it when it moves between modules.
``<!-- generated: flags run -->`` (``flags workload:from-log`` for an action)
    every argument of a sub-command, as its ``--help`` gives it (docgen/cli.py).
``<!-- generated: commands -->``
    a row per sub-command, as ``servetune --help`` lists them, each linked to its page.
``<!-- generated: metric-names -->``
    the flat metric names a level has (``servetune.metrics.metric_names``), the cost's and the energy's.
``<!-- generated: prices [LIST] -->``
    a shipped price list (``servetune.capacity.prices.load_price_table``; ``default`` when no LIST
    is named, else ``aws``, ``gcp`` or ``azure``): a row per GPU type with
    its price per device-hour, the offer and listed price it is derived from, region, evidence, the
    page's date and the date read, and the page.
``<!-- generated: mlflow -->``
    the names of what a study logs to MLflow: the stored demo study sent through servetune's own
    MLflow sync, with a client that keeps the names (docgen/mlflow_names.py).
``<!-- generated: include cluster/README.md -->``
    a Markdown file of the repository (a path from its root), each heading one level down, so
    the file stays where its readers and its tests find it and the site shows it all the same.

Nothing generated is written by hand, so a field, a flag or a logged name that changes in the code
changes the site; a marker this hook does not know stops ``mkdocs build`` (tests/unit/test_docs.py
builds it with ``--strict``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from docgen.cli import commands_table, flags_table  # docs/docgen: mkdocs puts this folder on sys.path
from docgen.mlflow_names import mlflow_names
from docgen.models import find_model, model_reference
from mkdocs.exceptions import PluginError
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
#: The study the MLflow names come from: a real `make demo` study, stored for the tests.
DEMO_STUDY = ROOT / "tests" / "data" / "cpu-tiny-study"
MARKER = re.compile(r"^<!-- generated: ([\w-]+)(?: (\S+))? -->$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each marker of the page by what it asks for; an unknown marker stops the build."""
    seen: set[type[BaseModel]] = set()  # a model shown once per page; later tables link to it

    def expand(match: re.Match[str]) -> str:
        kind, argument = match.group(1), match.group(2)
        if kind == "model" and argument:
            return model_reference(find_model(argument), seen)
        if kind == "flags" and argument:
            return flags_table(argument)
        if kind == "commands" and not argument:
            return commands_table()
        if kind == "metric-names" and not argument:
            return metric_names_list()
        if kind == "prices":
            return price_list(argument or "default")
        if kind == "mlflow" and not argument:
            return mlflow_names(DEMO_STUDY)
        if kind == "include" and argument:
            return included(argument)
        raise PluginError(f"{page.file.src_path}: unknown marker {match.group(0)}")

    return MARKER.sub(expand, markdown)


def metric_names_list() -> str:
    from servetune.metrics import COST_METRIC, ENERGY_METRICS, metric_names

    return "\n".join(f"- `{name}`" for name in [*metric_names(), COST_METRIC, *ENERGY_METRICS])


def price_list(name: str) -> str:
    """One shipped price list as a table: what each price is, how it was derived, and where and when it was read."""
    from servetune.capacity.prices import PRICE_LIST_FILES, load_price_table

    listed = next((known for known in PRICE_LIST_FILES if known == name), None)
    if listed is None:
        raise PluginError(f"prices: no price list {name} (shipped: {', '.join(PRICE_LIST_FILES)})")
    table = load_price_table(listed)
    rows = ["| GPU | $/GPU-hour | provider | derived from | region | evidence | page date | read | source |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for gpu, price in table.items():
        d = price.derivation
        derived = "-" if d is None else f"{d.offer}: ${d.listed_usd:g} per {d.per} / {d.gpus} GPU ({d.billing})"
        rows.append(
            f"| {gpu} | {price.usd_per_device_hour:g} | {price.provider} | {derived} | {d.region if d else '-'} | "
            f"{price.evidence} | {price.page_date or 'not shown'} | {price.date} | <{price.source}> |"
        )
    notes = [f"- **{gpu}**: {price.note}" for gpu, price in table.items() if price.note]
    return "\n".join([*rows, "", *notes])


def included(path: str) -> str:
    """A Markdown file of the repository, each heading outside code one level down."""
    file = (ROOT / path).resolve()
    if ROOT not in file.parents or not file.is_file():
        raise PluginError(f"include: no file {path} in the repository")
    lines, fenced = [], False
    for line in file.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        lines.append("#" + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(lines)
