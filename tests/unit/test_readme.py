"""The README says what the code does: its example space, and every flag its usage lines name."""

import argparse
import re
from pathlib import Path

import pytest
import yaml

from servetune.cli import build_parser
from servetune.config.space import SearchSpace
from servetune.config.workload import load_workload
from servetune.trial.context import resolve_levels

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_example_space_is_valid_and_its_levels_are_what_its_comment_says():
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if b.startswith("name: chat-latency"))
    space = SearchSpace.model_validate(yaml.safe_load(block))
    levels = resolve_levels(space, load_workload(space.workload))
    assert "clients in flight" in block and {level.kind for level in levels} == {"concurrency"}
    assert [level.value for level in levels] == [1, 4, 16, 64]


def usage_lines() -> list[tuple[str, str]]:
    """(sub-command, line) for every ``servetune COMMAND [ACTION] ...`` line in the README's bash blocks."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        command = None
        for line in block.splitlines():
            if m := re.match(r"\s*servetune ([\w-]+(?: [a-z][\w-]*)?)", line):
                command = m.group(1)
            elif not line.startswith(" "):
                command = None
            if command:
                lines.append((command, line))
    return lines


@pytest.mark.parametrize("command, line", usage_lines())
def test_every_flag_in_a_usage_line_exists(command, line):
    parser = build_parser()
    name, _, action = command.partition(" ")
    sub = parser._subparsers._group_actions[0].choices[name]  # argparse keeps them here
    nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
    if nested and action in nested[0].choices:  # servetune workload from-log: the action's own flags
        sub = nested[0].choices[action]
    known = {flag for action in sub._actions for flag in action.option_strings}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line.split("#")[0]))
    assert named <= known, f"{line!r}: {sorted(named - known)} not options of servetune {command}"
