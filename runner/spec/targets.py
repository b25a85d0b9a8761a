"""``_target_`` resolved statically, on the login node, without running any of the user's code.

``validate`` must not import the target: importing runs the package's ``__init__`` (user code, and torch for
seconds), and the package may exist only inside the image. Instead the module's file is found by path (only the
top-level package is asked of Python's finders, which execute nothing), parsed with ``ast``, and re-exports
(``from .sub import Name`` in an ``__init__.py``) are followed. A module that is not on this host is a note; the
real import is checked in the job, in the image, before training (``runner.job.targets``).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")
MAX_HOPS = 16  # re-exports followed before giving up (a cycle of re-exports ends here too)


@dataclass(frozen=True)
class Found:
    """What a static look-up learned: ``status`` is found, missing_module, missing_name or unknown."""

    status: str
    detail: str = ""
    node: ast.AST | None = None  # the class or function definition, when found


@dataclass(frozen=True)
class _Module:
    name: str
    source: Path | None  # None: a namespace package or a compiled module (nothing to parse)
    locations: tuple[str, ...]  # where its submodules live (empty for a plain module)


def _top(name: str, base: Path) -> _Module | None:
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, [str(base)]) or importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    return _Module(name, origin, tuple(spec.submodule_search_locations or ()))


def _child(parent: _Module, part: str) -> _Module | None:
    for loc in parent.locations:
        d = Path(loc) / part
        if (d / "__init__.py").is_file():
            return _Module(f"{parent.name}.{part}", d / "__init__.py", (str(d),))
        if (d.with_suffix(".py")).is_file():
            return _Module(f"{parent.name}.{part}", d.with_suffix(".py"), ())
        if any(d.parent.glob(f"{part}.*.so")) or any(d.parent.glob(f"{part}.*.pyd")):
            return _Module(f"{parent.name}.{part}", None, ())
        if d.is_dir():
            return _Module(f"{parent.name}.{part}", None, (str(d),))
    return None


def find_module(name: str, base: Path) -> _Module | None:
    parts = name.split(".")
    mod = _top(parts[0], base)
    for part in parts[1:]:
        if mod is None:
            return None
        mod = _child(mod, part)
    return mod


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, including those under ``if``/``try`` (conditional definitions and imports)."""
    out: list[ast.stmt] = []
    for st in body:
        out.append(st)
        if isinstance(st, ast.If):
            out += _statements(st.body) + _statements(st.orelse)
        elif isinstance(st, ast.Try):
            out += _statements(st.body) + _statements(st.orelse) + _statements(st.finalbody)
            for h in st.handlers:
                out += _statements(h.body)
    return out


def _absolute(mod: _Module, st: ast.ImportFrom) -> str:
    if not st.level:
        return st.module or ""
    package = mod.name if mod.locations and mod.source and mod.source.name == "__init__.py" else \
        mod.name.rpartition(".")[0]
    for _ in range(st.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{st.module}" if st.module else package


def _lookup(mod: _Module, attr: str, base: Path, hops: int) -> Found:
    if hops > MAX_HOPS:
        return Found("unknown", "too many re-exports to follow")
    if mod.source is None:  # a namespace package or a compiled module
        return Found("unknown", f"{mod.name} has no Python source here")
    try:
        tree = ast.parse(mod.source.read_bytes(), filename=str(mod.source))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return Found("unknown", f"{mod.source} cannot be parsed here")
    dynamic = False
    for st in _statements(tree.body):
        if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if st.name == attr:
                return Found("found", str(mod.source), st)
            dynamic |= st.name == "__getattr__"
        elif isinstance(st, (ast.Assign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return Found("found", str(mod.source))
        elif isinstance(st, ast.ImportFrom):
            for alias in st.names:
                if alias.name == "*" or (alias.asname or alias.name) == attr:
                    src = _absolute(mod, st)
                    if alias.name != "*" and find_module(f"{src}.{alias.name}", base) is not None:
                        return Found("missing_name", f"{attr} is a module")
                    target = find_module(src, base)
                    if target is None:
                        if alias.name == "*":
                            dynamic = True
                            continue
                        return Found("unknown", f"{src} is not on this host")
                    found = _lookup(target, attr if alias.name == "*" else alias.name, base, hops + 1)
                    if alias.name != "*" or found.status == "found":
                        return found
                    dynamic |= found.status == "unknown"  # a star import from a module we cannot read
        elif isinstance(st, ast.Import):
            if any((a.asname or a.name) == attr for a in st.names):
                return Found("missing_name", f"{attr} is a module")
    if dynamic:
        return Found("unknown", f"{mod.name} defines __getattr__ or star-imports a module that cannot be read")
    return Found("missing_name", f"no class or function {attr!r} in {mod.source}")


def resolve(target: str, base: Path) -> Found:
    """Find ``module.path.Name`` without importing: the longest importable module prefix, then the name in it."""
    if not DOTTED.fullmatch(target):
        return Found("invalid", "a dotted path like package.module.Class")
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = find_module(".".join(parts[:i]), base)
        if mod is None:
            continue
        found = _lookup(mod, parts[i], base, 0)
        for attr in parts[i + 1:]:  # Class.method (ESPnet3's runner classes): looked up in the class body
            if found.status != "found":
                break
            found = member(found.node, attr)
        return found
    return Found("missing_module", f"module {parts[0]!r} is not on this host")


def member(node: ast.AST | None, attr: str) -> Found:
    """``attr`` of a class definition: found in its body, unknown when it may be inherited or the node is not a
    class, missing when the class has no bases and does not define it."""
    if not isinstance(node, ast.ClassDef):
        return Found("unknown", f"{attr} of something that is not a class definition")
    for st in _statements(node.body):
        if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == attr:
            return Found("found", node.name, st)
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            names = st.targets if isinstance(st, ast.Assign) else [st.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in names):
                return Found("found", node.name)
    if node.bases or node.keywords:
        return Found("unknown", f"{attr} may be inherited by {node.name} from a base class")
    return Found("missing_name", f"class {node.name} has no {attr!r}")


def _init(node: ast.AST | None) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    if isinstance(node, ast.ClassDef):
        node = next((st for st in node.body if isinstance(st, ast.FunctionDef) and st.name == "__init__"), None)
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def params(node: ast.AST | None) -> set[str] | None:
    """The keyword arguments a class's ``__init__`` (or a function) takes; None when it takes ``**kwargs`` or
    cannot be told statically (an inherited ``__init__``, a name bound by assignment)."""
    fn = _init(node)
    if fn is None or fn.args.kwarg is not None:
        return None
    return {arg.arg for arg in (*fn.args.args, *fn.args.kwonlyargs)} - {"self"}


def accepts(node: ast.AST | None, name: str) -> bool | None:
    """Whether a class's ``__init__`` (or a function) takes ``name``; None when it cannot be told statically."""
    if _init(node) is None:
        return None
    known = params(node)
    return known is None or name in known
