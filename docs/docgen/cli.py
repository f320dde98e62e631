"""servetune's command line as Markdown: its sub-commands, and each one's arguments as ``--help`` gives them."""

from __future__ import annotations

import argparse

from mkdocs.exceptions import PluginError

from docgen import plain


def command_parser(name: str) -> argparse.ArgumentParser:
    """``run`` or ``workload:from-log``: the sub-command's (or its action's) parser."""
    from servetune.cli import build_parser

    parser = build_parser()
    for part in name.split(":"):
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or part not in subparsers[0].choices:
            raise PluginError(f"servetune has no command '{name.replace(':', ' ')}'")
        parser = subparsers[0].choices[part]
    return parser


def commands_table() -> str:
    """Each sub-command linked to its page (``commands/<name>.md``), with its one-line help."""
    from servetune.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["| command | what it does |", "|---|---|"]
    for choice in subparsers._choices_actions:
        lines.append(f"| [`servetune {choice.dest}`]({choice.dest}.md) | {plain(choice.help or '', in_table=True)} |")
    return "\n".join(lines)


def flags_table(name: str) -> str:
    parser = command_parser(name)
    formatter = parser._get_formatter()
    lines = ["| argument | what it is |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        invocation = formatter._format_action_invocation(action)
        text = (action.help or "") % {"default": action.default, "prog": parser.prog}
        cells = [f"`{invocation}`", " ".join(text.split())]
        lines.append("| " + " | ".join(plain(cell, in_table=True) for cell in cells) + " |")
    return "\n".join(lines)
