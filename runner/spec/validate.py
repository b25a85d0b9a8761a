"""Validation of a loaded config against the schema and the cross-field rules.

Every problem is collected and reported at once, one line each, in the form
``FILE:LINE: key.path: found X; expected Y. hint: Z`` so that a user fixes a config in one pass.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

from runner.spec import parallel
from runner.spec.schema import ENV_NAME, EVENTS, NONE, REQUIRED, SBATCH_SAFE, TRAINER_KEYS


class Problems:
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
    return "nothing" if v is REQUIRED else repr(v)



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


def check_schema(data: dict[str, Any], schema: dict[str, Any], problems: Problems, prefix: str = "") -> None:
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
            check_schema(sub, spec, problems, path + ".")
            continue
        if key not in data:
            if spec.default is REQUIRED:
                problems.add(path, REQUIRED, _type_name(spec.types), f"add {path} to the config")
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


def check_rules(d: dict[str, Any], problems: Problems) -> None:
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
    check_env(d["env"], problems)
    for key in ("apt", "pip", "binds", "code"):
        for i, item in enumerate(d["container"].get(key) or []):
            if not isinstance(item, str) or not item or "\n" in item:
                problems.add(f"container.{key}[{i}]", item, "a non-empty single-line string")
    for i, event in enumerate(d["alerts"].get("events") or []):
        if event not in EVENTS:
            problems.add(f"alerts.events[{i}]", event, "one of " + ", ".join(EVENTS))
    parallel.check(d["parallel"], problems, need_workload=False)


def check_env(env: dict[str, Any], problems: Problems) -> None:
    """``env:`` lands in export lines of job scripts: names must be names, values scalars."""
    for key, value in env.items():
        if not ENV_NAME.match(str(key)):
            problems.add(f"env.{key}", key, "an environment variable name", "use letters, digits and _")
        elif not isinstance(value, (str, int, float, bool)):
            problems.add(f"env.{key}", value, "a string or number")


def check_targets(d: dict[str, Any], problems: Problems, base: Path) -> None:
    """Check that each ``_target_`` imports, without importing heavy modules on the CLI path.

    We find the module's file with importlib's finder and look for the name in its source; importing the
    module would import torch (2-5 s) on every ``runner validate``.
    """
    import importlib.util
    import sys

    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    par = d.get("parallel") or {}
    targets = [(f"{s}._target_", (d.get(s) or {}).get("_target_")) for s in ("model", "data")]
    targets += [("parallel.provider._target_", (par.get("provider") or {}).get("_target_")),
                ("parallel.forward", par.get("forward")), ("parallel.reduce", par.get("reduce"))]
    for key, target in targets:
        if not isinstance(target, str):
            continue
        mod_name, _, attr = target.rpartition(".")
        try:
            spec = importlib.util.find_spec(mod_name) if mod_name else None
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            problems.add(key, target, "an importable module.Class path",
                         f"module {mod_name or target!r} was not found on PYTHONPATH")
            continue
        try:
            source = Path(spec.origin).read_text()
        except OSError:
            continue
        if not re.search(rf"^(class|def)\s+{re.escape(attr)}\b|^{re.escape(attr)}\s*=", source, re.M):
            problems.add(key, target, f"a class or function {attr!r} in {mod_name}",
                         "check the name's spelling")


def check_parallel(data: dict[str, Any], problems: Problems) -> None:
    """ESPnet3's ``parallel`` block is for Dask workloads; trainer settings there are a classic mistake."""
    par = data.get("parallel")
    if not isinstance(par, dict):
        return
    options: dict[str, Any] = par["options"] if isinstance(par.get("options"), dict) else {}
    misplaced = [k for k in TRAINER_KEYS if k in par or k in options]
    if misplaced:
        hint = "`parallel` is for Dask workloads in ESPnet3; DDP settings go under trainer:"
        problems.add("parallel", ", ".join(misplaced), "trainer settings under trainer:", hint)
    for key in misplaced:  # said once, here
        par.pop(key, None)
        options.pop(key, None)
