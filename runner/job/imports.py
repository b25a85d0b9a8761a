"""What a program imports, checked against the Python the ranks run before anything of it runs.

A program run with another Python than its packages' (runner's own venv instead of the recipe's) used to pass the
preflight and die 10 s later on ``ModuleNotFoundError``, on every rank. The preflight names this Python and looks up
each third-party package the program needs the way ``import`` would find it, without importing it: the top package of
``python -m pkg.mod``, or the script's module-level imports, read with ``ast`` (nothing of it runs). Only statements
at the module's top level count: an import inside ``try`` (an optional one), a function or an ``if`` may never run.
Standard library only.
"""

from __future__ import annotations

import ast
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import NamedTuple


class Need(NamedTuple):
    """A top-level package the program needs, and where it says so (for the refusal's line)."""

    package: str
    where: str  # "run.py:4" or "python -m"
    text: str  # the import statement as written, or the module ``-m`` runs


def top_level(source: str) -> list[tuple[str, int]]:
    """The top-level packages a module's own top-level statements import, each once with the line of its first
    import, in order (relative imports and ``__future__`` left out); [] for source that does not parse (the
    program's own error says more)."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return []
    found: dict[str, int] = {}
    for node in body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    found.pop("__future__", None)
    return list(found.items())


def imported(source: str) -> list[str]:
    """The names of ``top_level``."""
    return [name for name, _ in top_level(source)]


def _local(name: str, folder: Path) -> bool:
    """A module or package in ``folder``, which leads ``sys.path`` when the program runs (the script's own folder,
    or the working directory for ``-m``): the program's own code, not a package of the Python's."""
    return (folder / f"{name}.py").is_file() or (folder / name).is_dir()


def third_party(name: str, folder: Path) -> bool:
    return name not in sys.stdlib_module_names and not _local(name, folder)


def script_needs(script: Path) -> list[Need]:
    """The third-party packages ``script`` imports at its top level: not the standard library's, not its own code
    beside it; [] for a script that cannot be read."""
    try:
        source = script.read_text(errors="replace")
    except OSError:
        return []
    lines = source.splitlines()
    return [Need(name, f"{script.name}:{line}", lines[line - 1].strip() if line <= len(lines) else "")
            for name, line in top_level(source) if third_party(name, script.parent)]


def module_needs(module: str, cwd: Path) -> list[Need]:
    """``python -m module``: its top package, unless it is the standard library's or the working directory's."""
    top = module.split(".")[0]
    return [Need(top, "python -m", module)] if top and third_party(top, cwd) else []


def found(package: str) -> bool:
    """Whether this Python finds ``package`` (a top-level name: nothing is imported to answer)."""
    try:
        return find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def lacking(needs: list[Need]) -> list[Need]:
    """The needs this Python cannot meet."""
    return [n for n in needs if not found(n.package)]
