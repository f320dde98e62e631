"""A pydantic model, and every model its fields hold, as Markdown tables: type, default, bounds, description.

The description of a field is its ``description``, else the comments written beside and above it in
its class (read from the source), else the docstring of the model it is. A model is found by class
name in a package and the modules under it, so the tables follow it when it moves between modules.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import pkgutil
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import annotated_types
from mkdocs.exceptions import PluginError
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from docgen import plain

#: Comments that speak to a tool, not to a reader.
TOOL_COMMENT = re.compile(r"^(fmt:|noqa|type:|pragma|pyright:)")


def find_model(spec: str) -> type[BaseModel]:
    """``package:Name``: the pydantic model called Name in the package or any module under it."""
    package, _, name = spec.partition(":")
    module = importlib.import_module(package)
    found = getattr(module, name, None)
    if not _is_model(found) and hasattr(module, "__path__"):
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            candidate = getattr(importlib.import_module(info.name), name, None)
            if _is_model(candidate):
                found = candidate
                break
    if not _is_model(found):
        raise PluginError(f"no pydantic model {name} in {package}")
    return found


def _is_model(value: object) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel


def model_reference(root: type[BaseModel], seen: set[type[BaseModel]]) -> str:
    """A section per model reached from ``root`` (breadth first, in field order), each a table of fields."""
    order: list[type[BaseModel]] = []
    paths: dict[type[BaseModel], list[str]] = {root: []}
    queue = [root]
    while queue:
        model = queue.pop(0)
        if model in order:
            continue
        order.append(model)
        for name, field in model.model_fields.items():
            for inner, suffix in held_models(field.annotation):
                prefix = ".".join(p for p in (_first(paths[model]), name) if p)
                paths.setdefault(inner, []).append(prefix + suffix)
                if inner not in order:
                    queue.append(inner)
    sections = []
    for model in order:
        if model in seen:
            continue
        seen.add(model)
        sections.append(model_section(model, paths[model]))
    return "\n\n".join(sections)


def _first(paths: list[str]) -> str:
    return paths[0] if paths else ""


def held_models(tp: Any, suffix: str = "") -> Iterable[tuple[type[BaseModel], str]]:
    """The models a field's type holds, each with where it sits below the field (``[]``, ``.<key>``)."""
    if _is_model(tp):
        yield tp, suffix
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        yield from held_models(args[0], suffix)
    elif origin in (list, tuple, set, frozenset):
        for arg in args:
            if arg is not Ellipsis:
                yield from held_models(arg, suffix + "[]")
    elif origin is dict:
        yield from held_models(args[1], suffix + ".<key>")
    else:
        for arg in args:
            yield from held_models(arg, suffix)


def model_section(model: type[BaseModel], where: list[str]) -> str:
    lines = [f"### {model.__name__} {{#{anchor(model)}}}", ""]
    if where:
        shown = ", ".join(f"`{w}`" for w in dict.fromkeys(where))
        lines += [f"Found at {shown}.", ""]
    doc = docstring(model)
    if doc:
        lines += [plain(doc), ""]
    extra = model.model_config.get("extra")
    if extra == "forbid":
        lines += ["A key not listed here is refused as an unknown key, naming the file and where.", ""]
    elif extra == "ignore":
        lines += ["A key not listed here is ignored: a file a newer servetune wrote still reads.", ""]
    comments = field_comments(model)
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        typ = type_text(field.annotation)
        bounds = bounds_text(field.metadata)
        if bounds:
            typ += f", {bounds}"
        description = field.description or comments.get(name) or held_docstring(field.annotation)
        cells = [f"`{key}`", typ, default_text(field), rst_to_markdown(description)]
        lines.append("| " + " | ".join(plain(cell, in_table=True) for cell in cells) + " |")
    return "\n".join(lines)


def anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")  # a model's own, not one inherited from its base
    return rst_to_markdown(inspect.cleandoc(doc)) if doc else ""


def held_docstring(tp: Any) -> str:
    """The first paragraph of the docstring of the one model a field is (or is or null)."""
    held = list(dict.fromkeys(model for model, where in held_models(tp) if not where))
    if len(held) != 1:
        return ""
    doc = docstring(held[0])
    return doc.split("\n\n")[0].replace("\n", " ") if doc else ""


def rst_to_markdown(text: str) -> str:
    """Docstrings' ``code`` and :role:`~path.name` as Markdown code."""
    text = re.sub(r":\w+:`~?(?:[\w]+\.)*([\w]+(?:\(\))?)`", r"`\1`", text)
    return text.replace("``", "`")


# --- types, bounds, defaults --------------------------------------------------------------------

NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path", type(None): "null"}


def type_text(tp: Any) -> str:
    """A field's type in the words of a YAML or JSON file, models as links to their sections."""
    if tp is Any:
        return "any"
    if tp in NAMES:
        return NAMES[tp]
    if _is_model(tp):
        return f"[{tp.__name__}](#{anchor(tp)})"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        bounds = bounds_text(_annotated_metadata(args[1:]))
        return type_text(args[0]) + (f" ({bounds})" if bounds else "")
    if origin is typing.Literal:
        return " or ".join(f"`{json.dumps(value)}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(parts + (["null"] if type(None) in args else []))
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"list of {type_text(args[0]) if args else 'any'}"
    if origin is tuple:
        return "[" + ", ".join(type_text(arg) for arg in args) + "]"
    if origin is dict:
        key, value = args or (str, Any)
        return "mapping" if value is Any else f"mapping of {type_text(key)} to {type_text(value)}"
    return f"`{getattr(tp, '__name__', tp)}`"


def _annotated_metadata(items: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        out += item.metadata if isinstance(item, FieldInfo) else [item]
    return out


BOUNDS: dict[type, tuple[str, str]] = {
    annotated_types.Ge: ("ge", "≥"), annotated_types.Gt: ("gt", ">"),
    annotated_types.Le: ("le", "≤"), annotated_types.Lt: ("lt", "<"),
}  # fmt: skip


def bounds_text(metadata: Iterable[Any]) -> str:
    parts = []
    for item in metadata:
        if type(item) in BOUNDS:
            attribute, sign = BOUNDS[type(item)]
            parts.append(f"{sign} {getattr(item, attribute)}")
        elif getattr(item, "pattern", None):
            parts.append(f"matching `{item.pattern}`")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        try:
            if value == type(value)():
                return "each field's default"
        except ValueError:
            pass
    return f"`{json.dumps(to_jsonable_python(value))}`"


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Per field, the comment lines just above it and the comments on its own lines, for the
    model and its bases (a field a subclass declares again takes the subclass's)."""
    out: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if _is_model(klass):
            out.update(_class_comments(klass))
    return out


def _class_comments(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    out = {}
    classdef = ast.parse(source).body[0]
    assert isinstance(classdef, ast.ClassDef)
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        number = node.lineno - 1
        while number >= 1 and lines[number - 1].strip().startswith("#"):
            above.insert(0, comments[number])
            number -= 1
        end = node.end_lineno or node.lineno
        own = [comments[n] for n in range(node.lineno, end + 1) if n in comments]
        text = " ".join(c for c in above + own if c and not TOOL_COMMENT.match(c))
        if text:
            out[node.target.id] = text
    return out
