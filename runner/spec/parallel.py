"""ESPnet3's ``parallel:`` block: helper workloads (statistics, data preparation, inference) on Dask.

It stays apart from ``trainer:`` (Lightning DDP), as ESPnet3 insists. A config may hold only a ``parallel:``
block (``runner parallel CONF`` validates it with ``SCHEMA_PARALLEL``: the training sections are then not
required), or one next to ``trainer:`` (``runner validate`` and ``submit`` check its options too).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Protocol

from runner.spec import targets
from runner.spec.schema import REQUIRED, SBATCH_SAFE, SCHEMA

# Options each env accepts (the names are Dask's and dask-jobqueue's own, passed through).
OPTIONS = {
    "local": ("threads_per_worker", "memory_limit"),
    "local_gpu": ("threads_per_worker", "memory_limit"),
    "slurm": ("queue", "account", "cores", "memory", "processes", "walltime", "job_extra_directives", "job_mem",
              "job_cpu", "interface", "death_timeout", "worker_extra_args", "local_directory", "scheduler_options"),
}
# Options of the other envs are accepted and left unused, so one config switches env with an override.
KNOWN = tuple(dict.fromkeys(k for keys in OPTIONS.values() for k in keys))
# dask-jobqueue's `python` (how a worker job starts Python) may only be runner's ${container_python}: the ranks' exec
# prefix (image, binds, environment), written out and quoted by `runner submit` (runner.host.render.program_python)
# for a program's own worker jobs (ESPnet3's parallel: block); `runner parallel` starts its workers that way itself.
CONTAINER_PYTHON = "${container_python}"
# The sections a parallel run reads; the training sections may be present (and are checked by `runner validate`).
SHARED = ("name", "run_root", "container", "slurm", "env", "alerts", "parallel")
SCHEMA_PARALLEL: dict[str, Any] = {**{k: SCHEMA[k] for k in SHARED}, "*": tuple(k for k in SCHEMA if k not in SHARED)}


# ESPnet3's EnvironmentProvider methods that build a worker's environment (runner.parallel.worker uses the first).
BUILDERS = ("build_worker_setup_fn", "build_env_local", "build_env")


def forward_of(found: targets.Found) -> targets.Found:
    """``parallel.forward`` may name a runner class (ESPnet3's BaseRunner shape): its ``forward`` does the work."""
    return targets.member(found.node, "forward") if isinstance(found.node, ast.ClassDef) else found


def provider_of(found: targets.Found) -> targets.Found:
    """A provider class (ESPnet3's EnvironmentProvider shape) must have one of the builders, maybe inherited."""
    if not isinstance(found.node, ast.ClassDef):
        return found
    looks = [targets.member(found.node, b) for b in BUILDERS]
    if any(f.status != "missing_name" for f in looks):
        return found
    return targets.Found("missing_name", f"class {found.node.name} has none of {', '.join(BUILDERS)} (a provider "
                                         "class builds each worker's environment with one of them)")


class Adds(Protocol):
    def add(self, key: str, found: Any, expected: str, hint: str = "") -> None: ...


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def only_parallel(data: Mapping[str, Any]) -> bool:
    """A config for `runner parallel` alone: a parallel: block and none of the training sections."""
    return isinstance(data.get("parallel"), Mapping) and \
        not any(k in data for k in ("trainer", "model", "data", "command"))


def check(par: Mapping[str, Any], problems: Adds, need_workload: bool) -> None:
    """The block's rules beyond types: options known for its env, safe for job scripts; a workload to run."""
    options = par.get("options") or {}
    for key, value in options.items():
        if key == "python" and value == CONTAINER_PYTHON:
            continue
        if key not in KNOWN:
            problems.add(f"parallel.options.{key}", key, "an option of Dask (local) or dask-jobqueue (slurm)",
                         f"known: {', '.join(KNOWN)}, python: {CONTAINER_PYTHON}")
        # dask-jobqueue writes these into #SBATCH lines and the worker's command line without quoting.
        bad = [s for s in _strings(value) if not SBATCH_SAFE.match(s)]
        if bad:
            problems.add(f"parallel.options.{key}", bad[0], "a value without spaces or shell characters")
    provider = par.get("provider") or {}
    if provider and not isinstance(provider.get("_target_"), str):
        problems.add("parallel.provider._target_", provider.get("_target_", REQUIRED), "module.Class or function",
                     "the provider builds each worker's environment: _target_ plus keyword arguments")
    if need_workload:
        if par.get("forward") is None:
            problems.add("parallel.forward", REQUIRED, "module.function: forward(idx, **env)",
                         "the function applied to each item")
        if par.get("items") is None:
            problems.add("parallel.items", REQUIRED, "the number of items (forward gets idx 0 .. items-1)")
