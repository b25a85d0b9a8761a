"""What a program's script imports, checked against the Python the ranks run before anything starts.

A program run with another Python than its packages' (runner's own venv instead of the recipe's) used to pass the
preflight and die 10 s later on ``ModuleNotFoundError``, on every rank. Its main script's module-level imports are
read (``ast``: nothing of it runs) and each top-level package is looked up the way ``import`` would find it, without
importing it. Only statements at the module's top level count: an import inside ``try`` (an optional one), a
function or an ``if`` may never run. Standard library only.
"""

from __future__ import annotations

import ast
import sys
from importlib.util import find_spec
from pathlib import Path


def imported(source: str) -> list[str]:
    """The top-level packages a module's own top-level statements import, in order, each once (relative imports and
    ``__future__`` left out); [] for source that does not parse (the program's own error says more)."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return [n for i, n in enumerate(names) if n != "__future__" and n not in names[:i]]


def missing(script: Path) -> list[str]:
    """The packages ``script`` imports at its top level that this Python cannot find: not the standard library's,
    not a module beside the script (its folder leads ``sys.path`` when it runs), not on ``sys.path``."""
    try:
        source = script.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for name in imported(source):
        if name in sys.stdlib_module_names or (script.parent / f"{name}.py").is_file() or \
                (script.parent / name).is_dir():
            continue
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out
