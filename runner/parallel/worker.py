"""What runs inside a Dask worker (a local process, or a Slurm job in the image): build the workload's
environment once per worker, apply ``forward`` to each item of a chunk, retrying an item before giving it up.

Results must be JSON values: they are written into the run directory. This module imports the user's
targets (which may import torch): the driver on the login node only names them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.log import one_line
from runner.parallel.plan import CODE_PATH_ENV
from runner.parallel.store import Store
from runner.rundir import RunDir

_ENVS: dict[str, dict[str, Any]] = {}  # per worker process: provider (as JSON) -> its environment


def resolve(target: str) -> Callable[..., Any]:
    for entry in os.environ.get(CODE_PATH_ENV, "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    module, _, name = target.rpartition(".")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def environment(provider: dict[str, Any]) -> dict[str, Any]:
    """The provider's environment (dataset, model, ...), built once per worker and kept for every chunk.

    ``_target_`` is called with the other keys; it returns the environment mapping, or an object whose
    ``build_env()`` does (ESPnet3's provider classes).
    """
    key = json.dumps(provider, sort_keys=True)
    if key not in _ENVS:
        if not provider:
            _ENVS[key] = {}
        else:
            kwargs = {k: v for k, v in provider.items() if k != "_target_"}
            made = resolve(provider["_target_"])(**kwargs)
            _ENVS[key] = dict(made.build_env() if hasattr(made, "build_env") else made)
    return _ENVS[key]


def run_chunk(provider: dict[str, Any], forward: str, items: list[int], retries: int
              ) -> tuple[dict[int, Any], dict[int, str]]:
    """``forward(idx, **env)`` for each item; an item that raises is tried ``retries`` more times, then listed
    with its last error (one line). Returns (results, failed)."""
    env, fn = environment(provider), resolve(forward)
    results: dict[int, Any] = {}
    failed: dict[int, str] = {}
    for idx in items:
        for _ in range(retries + 1):
            try:
                value = fn(idx, **env)
                json.dumps(value)  # the store writes JSON: say so here, per item, not at the end
            except Exception as e:  # the user's code: anything may fail, and is listed
                failed[idx] = one_line(e)
                continue
            results[idx] = value
            failed.pop(idx, None)
            break
    return results, failed


def run_reduce(reduce: str, run_dir: str) -> Any:
    """The workload's ``reduce`` over every item's value in item order, read from the (shared) run directory.

    It runs in a worker: it may need torch, which the driver never imports."""
    return resolve(reduce)(v for _, v in Store(RunDir(Path(run_dir))).items())
