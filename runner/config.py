"""Load, interpolate and validate one run config (ESPnet3 style).

Every problem is collected and reported at once, one line each, in the form
``FILE:LINE: key.path: found X; expected Y. hint: Z`` so that a user fixes a config in one pass.
"""

from __future__ import annotations

import ast
import copy
import difflib
import hashlib
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.alerts import EVENTS
from runner.errors import ConfigError

_REQUIRED = object()
# Characters allowed in values that land in ``#SBATCH`` lines (sbatch parses those lines itself, so shell
# quoting cannot protect them): reject anything else instead of guessing how sbatch would read it.
SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.:,=@/+%\-\[\]]*$")
NGC_TAG = re.compile(r"^\d{2}\.(0[1-9]|1[0-2])$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")
STRATEGIES = ("ddp", "ddp_find_unused_parameters_true", "fsdp")
TRAINER_KEYS = (
    "accelerator", "strategy", "devices", "num_nodes", "precision", "max_epochs", "min_epochs", "max_steps",
    "min_steps", "max_time", "limit_train_batches", "limit_val_batches", "val_check_interval",
    "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps", "enable_progress_bar",
    "enable_model_summary", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
    "deterministic", "benchmark", "inference_mode", "detect_anomaly", "sync_batchnorm",
)


@dataclass(frozen=True)
class F:
    """One leaf of the schema: its type(s), default and constraints."""

    types: tuple[type, ...]
    default: Any = _REQUIRED
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    pattern: re.Pattern[str] | None = None
    expect: str = ""


def _f(types: type | tuple[type, ...], default: Any = _REQUIRED, **kw: Any) -> F:
    return F(types if isinstance(types, tuple) else (types,), default, **kw)


NONE = type(None)
POS_INT = {"min": 1}
_LOADER = {
    "total_shards": _f(int, 1, **POS_INT),
    "dist_world_size": _f(int, 1, **POS_INT),
    "batch_size": _f(int, 8, **POS_INT),
    "num_workers": _f(int, 0, min=0),
}

# The schema: dicts are sections, F are leaves, "*" means free-form (kwargs passed through).
SCHEMA: dict[str, Any] = {
    "name": _f((str, NONE), None, pattern=re.compile(r"^[A-Za-z0-9_.\-]+$"), expect="letters, digits, _ . -"),
    "num_nodes": _f(int, 1, **POS_INT),
    "num_device": _f(int, 1, **POS_INT),
    "seed": _f(int, 0, min=0),
    "scheduler": _f(str, "local", choices=("local", "slurm")),
    "run_root": _f(str, "runs", pattern=SBATCH_SAFE, expect="a path without spaces or shell characters"),
    "global_batch_size": _f((int, NONE), None, **POS_INT),
    "trainer": {
        "accelerator": _f(str, "cpu", choices=("cpu", "gpu", "cuda", "auto")),
        "devices": _f(int, _REQUIRED, **POS_INT),
        "num_nodes": _f(int, _REQUIRED, **POS_INT),
        "strategy": _f(str, "ddp", choices=STRATEGIES),
        "precision": _f((str, int), "32-true"),
        "max_steps": _f(int, -1, min=-1),
        "max_epochs": _f((int, NONE), None, min=-1),
        "accumulate_grad_batches": _f((int, NONE), None, **POS_INT),
        "*": TRAINER_KEYS,
    },
    "model": {"_target_": _f(str), "*": True},
    "data": {"_target_": _f(str), "*": True},
    "dataloader": {"train": dict(_LOADER), "valid": dict(_LOADER)},
    "container": {
        "ngc_tag": _f(str, "24.10", pattern=NGC_TAG, expect="an NGC release tag like 24.10 (YY.MM)"),
        "base_image": _f((str, NONE), None),
        "apt": _f(list, []),
        "pip": _f(list, []),
        "nccl_tests": _f(bool, False),
        "perftest": _f(bool, False),
        "install_lightning": _f(bool, True),
        "runtime": _f(str, "apptainer", choices=("apptainer", "singularity", "none")),
        "builder": _f(str, "auto", choices=("auto", "docker", "podman")),
        "image_dir": _f(str, "images"),
        "image": _f((str, NONE), None),
        "allow_missing_image": _f(bool, False),
        "binds": _f(list, []),
        "python": _f(str, "python"),
        "workdir": _f(str, "/workspace"),
        "code": _f(list, ["runner"]),
    },
    "slurm": {
        "partition": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "account": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "qos": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "constraint": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "time": _f((str, int), "01:00:00", pattern=TIME, expect="Slurm time like 01:00:00, 2-00:00:00 or minutes"),
        "cpus_per_task": _f(int, 4, **POS_INT),
        "mem": _f((str, int, NONE), None, pattern=SBATCH_SAFE),
        "gpus_per_node": _f((int, NONE), None, min=0),
        "extra_flags": _f(list, []),
        "signal": _f(str, "USR2", choices=("USR1", "USR2", "TERM", "INT", "HUP", "URG")),
        "signal_lead_s": _f(int, 120, min=10),
        "requeue": _f(bool, True),
    },
    "env": {"*": True},
    "network": {
        "ifname": _f((str, NONE), None, pattern=ENV_NAME, expect="an interface name like ib0 or eth0"),
        "ib_hca": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "debug": _f(bool, False),
        "pg_timeout_s": _f(int, 300, min=10),
    },
    "checkpoint": {
        "every_n_steps": _f(int, 100, **POS_INT),
        "keep_last": _f(int, 3, **POS_INT),
        "exact_resume": _f(bool, True),
    },
    "resume": {
        "enabled": _f(bool, True),
        "max_restarts": _f(int, 3, min=0),
        "backoff_s": _f((int, float), 60, min=0),
        "force": _f(bool, False),
    },
    "alerts": {
        "enabled": _f(bool, True),
        "kind": _f(str, "slack", choices=("slack", "json")),
        "url_env": _f(str, "RUNNER_WEBHOOK_URL", pattern=ENV_NAME),
        "url_file": _f((str, NONE), None),
        "events": _f(list, list(EVENTS)),
        "timeout_s": _f((int, float), 5, min=0.1),
        "retries": _f(int, 3, min=0),
        "backoff_s": _f((int, float), 1.0, min=0),
    },
    "preflight": {
        "enabled": _f(bool, True),
        "min_busbw_gbps": _f((int, float, NONE), None, min=0),
        "probe_mib": _f(int, 16, **POS_INT),
        "timeout_s": _f(int, 10, **POS_INT),
        "min_free_gb": _f((int, float), 1, min=0),
        "paths": _f(list, []),
        "fail_on_warn": _f(bool, False),
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_INTERP = re.compile(r"\$\{([^{}]+)\}")


@dataclass
class Config:
    """A validated, fully resolved config plus where it came from."""

    data: dict[str, Any]
    path: Path
    lines: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

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
        d = copy.deepcopy(self.data)
        for key in ("name", "num_nodes", "num_device", "scheduler", "run_root", "slurm", "alerts", "preflight",
                    "resume", "env", "network", "container"):
            d.pop(key, None)
        for key in ("devices", "num_nodes", "accumulate_grad_batches"):
            d["trainer"].pop(key, None)
        for split in d["dataloader"].values():
            split.pop("dist_world_size", None)
        d["global_batch"] = self.global_batch
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class _Problems:
    def __init__(self, path: Path, lines: dict[str, int]):
        self.path, self.lines, self.items = path, lines, []  # type: ignore[var-annotated]

    def add(self, key: str, found: Any, expected: str, hint: str = "") -> None:
        line = self.lines.get(key) or self.lines.get(key.rsplit(".", 1)[0]) or 0
        where = f"{self.path}:{line}" if line else str(self.path)
        msg = f"{where}: {key}: found {_show(found)}; expected {expected}"
        self.items.append(msg + (f". hint: {hint}" if hint else ""))


def _show(v: Any) -> str:
    if isinstance(v, str):
        return repr(v) if len(v) < 60 else repr(v[:57] + "...")
    return "nothing" if v is _REQUIRED else repr(v)


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


def _resolve_all(node: Any, root: dict[str, Any], builtins: dict[str, Any], problems: _Problems, path: str) -> Any:
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


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list",
             NONE: "null", dict: "a mapping"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check(data: dict[str, Any], schema: dict[str, Any], problems: _Problems, prefix: str = "") -> None:
    """Check types and unknown keys, filling defaults in place."""
    free = schema.get("*")
    for key in list(data):
        path = f"{prefix}{key}"
        if key in schema and key != "*":
            continue
        if free is True or (isinstance(free, tuple) and key in free):
            continue
        known = [k for k in schema if k != "*"] + (list(free) if isinstance(free, tuple) else [])
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(known)}"
        problems.add(path, key, "a known key", hint)
    for key, spec in schema.items():
        if key == "*":
            continue
        path = f"{prefix}{key}"
        if isinstance(spec, dict):
            sub = data.setdefault(key, {})
            if sub is None:
                sub = data[key] = {}
            if not isinstance(sub, dict):
                problems.add(path, sub, "a mapping")
                continue
            _check(sub, spec, problems, path + ".")
            continue
        if key not in data:
            if spec.default is _REQUIRED:
                problems.add(path, _REQUIRED, _type_name(spec.types), f"add {path} to the config")
            else:
                data[key] = copy.deepcopy(spec.default)
            continue
        value = data[key]
        if not _type_ok(value, spec.types):
            quote = str in spec.types and isinstance(value, (int, float)) and not isinstance(value, bool)
            problems.add(path, value, spec.expect or _type_name(spec.types),
                         f"quote it: YAML reads {value!r} as a number" if quote else "")
        elif spec.choices and value not in spec.choices:
            problems.add(path, value, "one of " + ", ".join(map(str, spec.choices)))
        elif spec.min is not None and isinstance(value, (int, float)) and value < spec.min:
            problems.add(path, value, f"a value >= {spec.min:g}", "counts and sizes must be positive")
        elif spec.pattern and isinstance(value, str) and not spec.pattern.match(value):
            problems.add(path, value, spec.expect or f"a value matching {spec.pattern.pattern}")


def _check_rules(d: dict[str, Any], problems: _Problems) -> None:
    """Cross-field rules: the ESPnet3 sharding rules, devices/num_nodes agreement, batch arithmetic."""
    nodes, ndev, tr = d["num_nodes"], d["num_device"], d["trainer"]
    if not all(isinstance(x, int) for x in (nodes, ndev, tr.get("devices"), tr.get("num_nodes"))):
        return
    world = nodes * ndev
    if tr["devices"] != ndev:
        problems.add("trainer.devices", tr["devices"], f"{ndev} (= num_device)", "set trainer.devices: ${num_device}")
    if tr["num_nodes"] != nodes:
        problems.add("trainer.num_nodes", tr["num_nodes"], f"{nodes} (= num_nodes)",
                     "set trainer.num_nodes: ${num_nodes}")
    for split, loader in d["dataloader"].items():
        dws, shards = loader.get("dist_world_size"), loader.get("total_shards")
        if not isinstance(dws, int) or not isinstance(shards, int) or dws < 1:
            continue
        if dws != world:
            problems.add(f"dataloader.{split}.dist_world_size", dws, f"{world} (= num_nodes x num_device)",
                         "set dist_world_size: ${num_nodes * num_device}")
        elif shards % dws:
            up = -(-shards // dws) * dws
            problems.add(f"dataloader.{split}.total_shards", shards, f"a multiple of dist_world_size={dws}",
                         f"use total_shards: {up}")
    local, acc, glob = d["dataloader"]["train"].get("batch_size"), tr.get("accumulate_grad_batches"), \
        d.get("global_batch_size")
    if not isinstance(local, int) or local < 1:
        return
    if glob is not None and isinstance(glob, int):
        per_step = local * world
        if glob % per_step:
            problems.add("global_batch_size", glob, f"a multiple of batch_size x world size = {per_step}",
                         "change global_batch_size or dataloader.train.batch_size")
        elif acc is not None and acc != glob // per_step:
            problems.add("trainer.accumulate_grad_batches", acc, f"{glob // per_step} (derived from global_batch_size)",
                         "remove accumulate_grad_batches when global_batch_size is set")
        else:
            tr["accumulate_grad_batches"] = glob // per_step
    elif acc is None:
        tr["accumulate_grad_batches"] = 1
    if tr["max_steps"] == -1 and tr.get("max_epochs") is None:
        problems.add("trainer.max_steps", None, "trainer.max_steps or trainer.max_epochs", "set trainer.max_steps")
    slurm = d["slurm"]
    for i, flag in enumerate(slurm.get("extra_flags") or []):
        if not isinstance(flag, str) or not flag.startswith("--") or not SBATCH_SAFE.match(flag):
            problems.add(f"slurm.extra_flags[{i}]", flag, "an sbatch flag like --mail-type=END (no spaces/quotes)")
    for key, value in d["env"].items():
        if not ENV_NAME.match(str(key)):
            problems.add(f"env.{key}", key, "an environment variable name", "use letters, digits and _")
        elif not isinstance(value, (str, int, float, bool)):
            problems.add(f"env.{key}", value, "a string or number")
    for key in ("apt", "pip", "binds", "code"):
        for i, item in enumerate(d["container"].get(key) or []):
            if not isinstance(item, str) or not item or "\n" in item:
                problems.add(f"container.{key}[{i}]", item, "a non-empty single-line string")
    for i, event in enumerate(d["alerts"].get("events") or []):
        if event not in EVENTS:
            problems.add(f"alerts.events[{i}]", event, "one of " + ", ".join(EVENTS))


def _check_targets(d: dict[str, Any], problems: _Problems, base: Path) -> None:
    """Check that each ``_target_`` imports, without importing heavy modules on the CLI path.

    We find the module's file with importlib's finder and look for the name in its source; importing the
    module would import torch (2-5 s) on every ``runner validate``.
    """
    import importlib.util
    import sys

    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    for section in ("model", "data"):
        target = d.get(section, {}).get("_target_")
        if not isinstance(target, str):
            continue
        mod_name, _, attr = target.rpartition(".")
        try:
            spec = importlib.util.find_spec(mod_name) if mod_name else None
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            problems.add(f"{section}._target_", target, "an importable module.Class path",
                         f"module {mod_name or target!r} was not found on PYTHONPATH")
            continue
        try:
            source = Path(spec.origin).read_text()
        except OSError:
            continue
        if not re.search(rf"^(class|def)\s+{re.escape(attr)}\b|^{re.escape(attr)}\s*=", source, re.M):
            problems.add(f"{section}._target_", target, f"a class or function {attr!r} in {mod_name}",
                         "check the name's spelling")


def _check_parallel(data: dict[str, Any], problems: _Problems) -> None:
    """ESPnet3's ``parallel`` block is for Dask workloads; trainer settings there are a classic mistake."""
    par = data.pop("parallel", None)
    if par is None:
        return
    flat = json.dumps(par)
    misplaced = [k for k in TRAINER_KEYS if f'"{k}"' in flat]
    hint = "`parallel` is for Dask workloads in ESPnet3; DDP settings go under trainer:"
    problems.add("parallel", ", ".join(misplaced) or par, "trainer settings under trainer:", hint)


def load(path: str | Path, overrides: list[str] | None = None, run_dir: str = "${run_dir}") -> Config:
    """Read, override, interpolate and validate a config; raise ConfigError listing every problem."""
    path = Path(path)
    data, lines = read_yaml(path)
    apply_overrides(data, overrides or [])
    problems = _Problems(path, lines)
    _check_parallel(data, problems)
    data.setdefault("name", None)
    builtins = {"run_dir": run_dir}
    data = _resolve_all(data, data, builtins, problems, "")
    if data.get("name") is None:
        data["name"] = re.sub(r"[^A-Za-z0-9_.\-]", "-", path.stem)
    _check(data, SCHEMA, problems)
    if not problems.items:
        _check_rules(data, problems)
        _check_targets(data, problems, path.resolve().parent)
    if problems.items:
        raise ConfigError(problems.items)
    return Config(data=data, path=path, lines=lines)


def from_dict(data: dict[str, Any], path: Path) -> Config:
    """Rebuild a Config from an already resolved dict (as stored in a run directory)."""
    return Config(data=data, path=path)
