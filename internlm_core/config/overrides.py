"""`--set KEY=VALUE` overrides: a value is read as a config file reads it (Python literals, lists, tuples, dicts,
`dict(k=v)`, through an AST whitelist: nothing is executed), else as YAML reads it (`torch.float32`, `byte`); a
value that calls anything else is refused in one line at load."""

from __future__ import annotations

import ast
from typing import Any, Iterable

import yaml

from ..errors import ConfigError


def parse_overrides(items: Iterable[str]) -> list[tuple[list[str], Any]]:
    """`["data.total_steps=20", "model.dtype=torch.float32"]` → [(["data", "total_steps"], 20), ...]."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. data.total_steps=20")
        key, text = item.split("=", 1)
        out.append((key.strip().split("."), _parse_value(text.strip(), key.strip())))
    return out


# the calls a --set value may hold, as in a config file: dict(k=v, ...), list(...), tuple(...) of literals
_LITERAL_CALLS = {"dict": dict, "list": list, "tuple": tuple}


class _NotLiteral(ValueError):
    """A part of a --set value that is not a Python literal (its text in the message)."""


def _literal(node: ast.AST) -> Any:
    """The value of an expression made of literals, containers and `dict(k=v)` / `list(...)` / `tuple(...)` calls
    (an AST whitelist: nothing is executed); _NotLiteral for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _LITERAL_CALLS:
        if node.func.id == "dict" and not node.args and all(k.arg is not None for k in node.keywords):
            return {k.arg: _literal(k.value) for k in node.keywords}
        if node.func.id != "dict" and len(node.args) <= 1 and not node.keywords:
            return _LITERAL_CALLS[node.func.id](_literal(node.args[0]) if node.args else ())
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items) if isinstance(node, ast.Tuple) else set(items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    try:
        return ast.literal_eval(node)  # constants, -1, 1e-3, 2+3j
    except ValueError:
        raise _NotLiteral(ast.unparse(node)) from None


def _parse_value(text: str, key: str = "") -> Any:
    """A --set value: a Python literal as a config file writes it (numbers, strings, True/None, lists, tuples,
    dicts, `dict(k=v)`), else YAML's reading of it (`torch.float32`, `byte`, `[a, b]` are strings); a value
    that calls anything but dict/list/tuple is refused in one line rather than read as text."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        tree = None
    if tree is not None:
        try:
            return _literal(tree)
        except _NotLiteral as e:
            if any(isinstance(n, ast.Call) for n in ast.walk(tree)):
                raise ConfigError(f"--set {key}: {e} is not a literal; a value may hold numbers, strings, True/"
                                  "False/None, lists, tuples, dicts and dict(k=v, ...) of them") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: Iterable[tuple[list[str], Any]]) -> dict:
    """Set each dotted key in the raw dict (unknown keys are reported later by validation)."""
    for keys, value in overrides:
        node = raw
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {'.'.join(keys)}: {'.'.join(keys[:i + 1])} is not a section")
            node = nxt
        node[keys[-1]] = value
    return raw
