"""Reading a config: YAML with line numbers, ``key=value`` overrides and ``${...}`` interpolation.

``load`` is the one entry point: read, override, interpolate, then validate (``runner.spec.validate``).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.errors import ConfigError
from runner.spec import parallel, validate
from runner.spec.schema import SCHEMA
from runner.spec.typed import RunConfig, view
from runner.spec.validate import Problems

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_INTERP = re.compile(r"\$\{([^{}]+)\}")


@dataclass
class Config:
    """A validated, fully resolved config plus where it came from."""

    data: RunConfig
    path: Path
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def world_size(self) -> int:
        return int(self.data["num_nodes"]) * int(self.data["num_device"])

    @property
    def local_batch(self) -> int:
        return int(self.data["dataloader"]["train"]["batch_size"])

    @property
    def accumulate(self) -> int:
        return int(self.data["trainer"]["accumulate_grad_batches"])

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.world_size * self.accumulate

    def hash(self) -> str:
        """Hash of everything that determines the training trajectory.

        The node count, the scheduler and alert settings are left out so that a run can resume on other
        capacity (accumulation is re-derived to keep the global batch) without being called a new config.
        """
        d: dict[str, Any] = copy.deepcopy(dict(self.data))
        for key in ("name", "num_nodes", "num_device", "scheduler", "run_root", "slurm", "alerts", "preflight",
                    "resume", "env", "network", "container", "parallel"):
            d.pop(key, None)
        for key in ("devices", "num_nodes", "accumulate_grad_batches"):
            d["trainer"].pop(key, None)
        for split in d["dataloader"].values():
            split.pop("dist_world_size", None)
        d["global_batch"] = self.global_batch
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _line_map(node: yaml.Node, prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """Map each dotted key path to its 1-based line in the YAML file."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = f"{prefix}.{k.value}" if prefix else str(k.value)
            out[path] = k.start_mark.line + 1
            _line_map(v, path, out)
    return out


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a YAML mapping, turning syntax errors into one-line ConfigErrors with a line number."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config: {e.strerror}. hint: check the path"]) from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = f":{mark.line + 1}" if mark else ""
        problem = (e.problem or "syntax error").replace("\n", " ")
        raise ConfigError([f"{path}{line}: YAML syntax error: {problem}. hint: check indentation and quoting"]) \
            from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: found {type(data).__name__} at top level; expected a mapping of keys"])
    return data, _line_map(node) if node else {}


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError([f"override {dotted}: {p} is not a mapping. hint: check the key path"])
    d[last] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``key.path=value`` overrides; values are parsed as YAML scalars (so 2 is an int)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: found no '='; expected key.path=value. hint: trainer.max_steps=10"])
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set(data, key.strip(), value)


def _lookup(root: dict[str, Any], dotted: str) -> Any:
    cur: Any = root
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def _eval(expr: str, root: dict[str, Any], builtins: dict[str, Any]) -> Any:
    """Evaluate ``a.b`` or small integer arithmetic like ``num_nodes * num_device`` (no calls, no attributes)."""
    tree = ast.parse(expr.strip(), mode="eval")

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, (ast.Name, ast.Attribute)):
            name = ast.unparse(n)
            if name in builtins:
                return builtins[name]
            value = _lookup(root, name)
            return _resolve_value(value, root, builtins, {name})
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(expr)

    return ev(tree)


def _resolve_value(value: Any, root: dict[str, Any], builtins: dict[str, Any], seen: set[str]) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    whole = _INTERP.fullmatch(value.strip())
    if whole:
        key = whole.group(1).strip()
        if key in seen:
            raise RecursionError(key)
        return _eval(key, root, builtins)
    return _INTERP.sub(lambda m: str(_eval(m.group(1), root, builtins)), value)


def _resolve_all(node: Any, root: dict[str, Any], builtins: dict[str, Any], problems: Problems, path: str) -> Any:
    if isinstance(node, dict):
        return {k: _resolve_all(v, root, builtins, problems, f"{path}.{k}" if path else str(k))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve_all(v, root, builtins, problems, path) for v in node]
    try:
        return _resolve_value(node, root, builtins, set())
    except (KeyError, ValueError, SyntaxError, RecursionError, TypeError, ZeroDivisionError):
        problems.add(path, node, "an interpolation of an existing key (e.g. ${num_device})",
                     "check the spelling of the key inside ${...}")
        return node



def load(path: str | Path, overrides: list[str] | None = None, run_dir: str = "${run_dir}",
         kind: str = "train") -> Config:
    """Read, override, interpolate and validate a config; raise ConfigError listing every problem.

    ``kind="parallel"`` (``runner parallel``) checks only what a Dask workload reads (``SCHEMA_PARALLEL``):
    its ``data`` then holds no training sections, and the training properties of Config do not apply.
    """
    path = Path(path)
    data, lines = read_yaml(path)
    apply_overrides(data, overrides or [])
    problems = Problems(path, lines)
    validate.check_parallel(data, problems)
    if kind == "train" and parallel.only_parallel(data):
        raise ConfigError([f"{path}: found only a parallel: block (a Dask workload); expected a training config "
                           f"(trainer:, model:, data:). hint: run it with `runner parallel {path}`"])
    data.setdefault("name", None)
    builtins = {"run_dir": run_dir}
    data = _resolve_all(data, data, builtins, problems, "")
    if data.get("name") is None:
        data["name"] = re.sub(r"[^A-Za-z0-9_.\-]", "-", path.stem)
    validate.check_schema(data, SCHEMA if kind == "train" else parallel.SCHEMA_PARALLEL, problems)
    if not problems.items:
        if kind == "train":
            validate.check_rules(data, problems)
        else:
            parallel.check(data["parallel"], problems, need_workload=True)
            validate.check_env(data["env"], problems)
        validate.check_targets(data, problems, path.resolve().parent)
    if problems.items:
        raise ConfigError(problems.items)
    return Config(data=view(data), path=path, lines=lines)


def from_dict(data: dict[str, Any], path: Path) -> Config:
    """Rebuild a Config from an already resolved dict (as stored in a run directory)."""
    return Config(data=view(data), path=path)

