"""What docs/hooks.py generates: parts of the site built from servetune's code when the site builds."""

from __future__ import annotations


def plain(text: str, in_table: bool = False) -> str:
    """Text from the code as Markdown that shows it as written: ``<stem>`` and ``a | b`` outside code
    spans escaped (Markdown would take the first for HTML, a table the second for a cell's end), code
    spans left as they are (their pipes do not end a cell)."""
    parts = (" ".join(text.split()) if in_table else text).split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
        if in_table:
            parts[i] = parts[i].replace("|", "\\|")
    return "`".join(parts)
