"""The shape rules of docs/architecture.md, checked on the source: no function or method in internlm_core/ longer
than 80 lines (its def line to the last line of its body, docstring included) and no file longer than 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "internlm_core"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 450

# path (relative to the repository) → why it may break the rules for now; remove the entry when it is fixed
KNOWN_EXCEPTIONS = {
}


def _sources() -> list[tuple[str, str]]:
    """(path relative to the repository, source) of every module of the package, except the known exceptions."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel not in KNOWN_EXCEPTIONS:
            out.append((rel, path.read_text(encoding="utf-8")))
    return out


def long_functions(rel: str, source: str) -> list[str]:
    """`path:line name (N lines)` of every function or method (nested ones included) over the limit."""
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_80_lines():
    offenders = [o for rel, source in _sources() for o in long_functions(rel, source)]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split them by meaning):\n  "
                           + "\n  ".join(offenders))


def test_no_file_over_450_lines():
    offenders = [f"{rel} ({len(source.splitlines())} lines)" for rel, source in _sources()
                 if len(source.splitlines()) > MAX_FILE_LINES]
    assert not offenders, f"files over {MAX_FILE_LINES} lines (split them by meaning):\n  " + "\n  ".join(offenders)


def test_the_check_sees_an_overlong_function_and_names_it():
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\ndef g():\n    return 1\n"
    assert long_functions("pkg/m.py", source) == [f"pkg/m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert all(path.exists() for path in (PACKAGE.parent / rel for rel in KNOWN_EXCEPTIONS))
