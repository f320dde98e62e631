"""Constraints of a search space: small boolean expressions over its parameters, a safe subset of Python.

``tensor_parallel_size * data_parallel_size <= devices_per_node``: names (``env.X`` as one dotted name),
numbers, strings, lists, arithmetic, comparisons and ``and``/``or``/``not``; nothing is called, nothing
is imported. :func:`parse_constraint` refuses anything else when the space loads; :func:`evaluate_constraint` judges one choice;
:func:`constraint_names` lists what an expression reads, so a misspelt name is found before any trial.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from servetune.errors import UserError

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}  # fmt: skip
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}  # fmt: skip


def parse_constraint(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"constraint '{text}' is not an expression") from None
    for node in ast.walk(tree):
        allowed = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.BinOp,
                   ast.Compare, ast.Name, ast.Load, ast.Constant, ast.Attribute, ast.List, ast.Tuple,
                   *_BINOPS, *_CMPOPS)  # fmt: skip
        if not isinstance(node, allowed):
            raise ValueError(
                f"constraint '{text}': '{type(node).__name__}' is not allowed (use names, numbers, arithmetic, comparisons, and/or/not)"
            )
    return tree


def evaluate_constraint(text: str, names: dict[str, Any]) -> bool:
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node)
            if name not in names:
                raise UserError(
                    f"constraint '{text}': '{name}' is neither a parameter, a fixed engine argument, nor devices_per_node"
                )
            return names[name]
        if isinstance(node, ast.BoolOp):
            values = (ev(v) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp):
            return (not ev(node.operand)) if isinstance(node.op, ast.Not) else -ev(node.operand)
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                right = ev(comparator)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        raise UserError(f"constraint '{text}': cannot evaluate {type(node).__name__}")

    return bool(ev(parse_constraint(text)))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    assert isinstance(node, ast.Name)
    return node.id


def constraint_names(text: str) -> list[str]:
    """The variables a constraint reads, ``env.X`` as one dotted name."""
    return _names(parse_constraint(text))


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.Name, ast.Attribute)):
        return [_dotted(node)]
    return [name for child in ast.iter_child_nodes(node) for name in _names(child)]
