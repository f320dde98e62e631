"""The README and the docs say what the code does: the two commands, the example space, and every
``servetune`` command and flag they name.

The docs are every page under docs/ and the files the site includes (cluster/README.md). A flag is
checked where it is named with its command: on a line of a code block that runs ``servetune CMD``
(and the lines continuing it), and in an inline code span that starts with ``servetune CMD`` or
``CMD``. A span that is only flags (`` `--pick` ``) is checked on a command's page
(docs/commands/CMD.md), against that command; elsewhere a flag is checked when named with its
command, as other tools' flags (`` `--runtime-env-json` ``) are named there too.
"""

import argparse
import re
from pathlib import Path

import pytest
import yaml

from servetune.cli import build_parser
from servetune.config.space import SearchSpace
from servetune.config.workload import load_workload
from servetune.trial.context import resolve_levels

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
COMMAND_PAGES = DOCS / "commands"
#: Markdown the site shows besides docs/ (docs/hooks.py's ``include`` markers).
INCLUDED = [ROOT / "cluster" / "README.md"]
PAGES = [README, *sorted(DOCS.rglob("*.md")), *INCLUDED]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- the README's two commands, and its length ------------------------------------------------


def test_the_readme_gives_the_two_commands_that_ci_runs():
    block = re.search(r"## Set up and run\n.*?```bash\n(.*?)```", text(README), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make demo", "make test"]
    targets = set(re.findall(r"^([\w-]+):", text(ROOT / "Makefile"), re.M))
    assert {"demo", "test"} <= targets
    assert re.search(r"^make test$", text(ROOT / ".ci" / "run"), re.M)  # CI runs the README's test command


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = text(README)
    assert len(readme.splitlines()) <= 150, "the README is read in five minutes: the rest goes to docs/"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


# --- the example space --------------------------------------------------------------------------


def test_the_example_space_is_valid_and_its_levels_are_what_its_comment_says():
    blocks = [b for page in PAGES for b in re.findall(r"```yaml\n(.*?)```", text(page), re.S)]
    block = next(b for b in blocks if b.startswith("name: chat-latency"))
    space = SearchSpace.model_validate(yaml.safe_load(block))
    levels = resolve_levels(space, load_workload(space.workload))
    assert "clients in flight" in block and {level.kind for level in levels} == {"concurrency"}
    assert [level.value for level in levels] == [1, 4, 16, 64]


# --- commands and flags -------------------------------------------------------------------------


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """``run``, ``workload from-log``...: every command and action, with its parser."""
    out = {}
    for command, parser in build_parser()._subparsers._group_actions[0].choices.items():  # argparse keeps them here
        out[command] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{command} {name}": sub for name, sub in action.choices.items()})
    return out


COMMANDS = subcommands()
TOP = sorted((c for c in COMMANDS if " " not in c), key=len, reverse=True)  # serve-check before a shorter name
NAMED = re.compile(r"(?:(?<![\w./-])|(?<=bin/))servetune (" + "|".join(map(re.escape, TOP)) + r")\b(?: ([a-z][\w-]*))?")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def flags_of(command: str) -> set[str]:
    return {flag for action in COMMANDS[command]._actions for flag in action.option_strings}


def has_actions(command: str) -> bool:
    """``servetune workload`` has actions (``from-log``): its page lists theirs, it has no flags of its own."""
    return any(isinstance(a, argparse._SubParsersAction) for a in COMMANDS[command]._actions)


def command_at(match: re.Match[str]) -> str:
    command, action = match.group(1), match.group(2)
    return f"{command} {action}" if f"{command} {action}" in COMMANDS else command


def code_lines(page: Path) -> list[tuple[str, str]]:
    """(command, text) for every code-block line that runs ``servetune CMD``, and the lines continuing it."""
    out = []
    for block in re.findall(r"```(?:bash|console|text)\n(.*?)```", text(page), re.S):
        command = None
        for line in block.splitlines():
            if m := NAMED.search(line):
                command, line = command_at(m), line[m.start() :]
            elif not line.startswith(" "):
                command = None
            if command:
                out.append((command, line.split(" #")[0]))
    return out


def page_command(page: Path) -> str | None:
    """The command a page under docs/commands/ is about (``workload`` covers ``workload from-log``)."""
    return page.stem if page.parent == COMMAND_PAGES and page.stem in COMMANDS else None


def spans(page: Path) -> list[tuple[str | None, str]]:
    """(command, span) for every inline code span naming flags: its own command, or None for bare flags."""
    prose = re.sub(r"```.*?```", "", text(page), flags=re.S)
    out = []
    for span in SPAN.findall(prose):
        words = span.removeprefix("servetune ").split(" ")
        if " ".join(words[:2]) in COMMANDS:
            out.append((" ".join(words[:2]), span))
        elif words[0] in COMMANDS:
            out.append((words[0], span))
        elif span.startswith("--") and page_command(page):
            out.append((None, span))
    return out


CHECKS = [(name(page), command, line) for page in PAGES for command, line in code_lines(page)]
SPANS = [(name(page), page_command(page), command, span) for page in PAGES for command, span in spans(page)]


def test_the_pages_name_commands_and_flags():
    assert len(CHECKS) > 30 and len(SPANS) > 50  # the parsing above finds what the pages hold


@pytest.mark.parametrize("page, command, line", CHECKS)
def test_every_flag_on_a_command_line_exists(page, command, line):
    named = set(FLAG.findall(line))
    assert named <= flags_of(command), (
        f"{page}: {line!r}: {sorted(named - flags_of(command))} not options of servetune {command}"
    )


@pytest.mark.parametrize("page, page_command, command, span", SPANS)
def test_every_flag_in_an_inline_span_exists(page, page_command, command, span):
    candidates = [command] if command else [c for c in COMMANDS if c.split(" ")[0] == page_command]
    known = set().union(*(flags_of(c) for c in candidates))
    named = set(FLAG.findall(span))
    assert named <= known, (
        f"{page}: `{span}`: {sorted(named - known)} not options of servetune {' or '.join(candidates)}"
    )


@pytest.mark.parametrize("command", sorted(c for c in COMMANDS if not has_actions(c)))
def test_every_command_has_a_page_that_lists_its_flags(command):
    """docs/commands/CMD.md for each command; it ends in the table of its arguments, which docs/hooks.py
    generates from the parser (``<!-- generated: flags CMD -->``), so a new flag is never missing."""
    top, _, action = command.partition(" ")
    page = COMMAND_PAGES / f"{top}.md"
    assert page.is_file(), f"no page for servetune {top}"
    marker = f"<!-- generated: flags {top}{':' + action if action else ''} -->"
    assert marker in text(page), f"{name(page)} has no {marker}"
