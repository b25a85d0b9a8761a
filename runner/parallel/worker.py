"""What runs inside a Dask worker (a local process, or a Slurm job in the image): build the workload's
environment once per worker, apply ``forward`` to each item of a chunk, retrying an item before giving it up.

Results must be JSON values: they are written into the run directory. This module imports the user's
targets (which may import torch): the driver on the login node only names them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runner.log import one_line
from runner.parallel.plan import CODE_PATH_ENV
from runner.parallel.store import Store
from runner.rundir import RunDir
from runner.spec.parallel import BUILDERS

_ENVS: dict[str, dict[str, Any]] = {}  # per worker process: provider (as JSON) -> its environment


def resolve_object(target: str) -> Any:
    """``module.name`` or ``module.Class.attribute``: the longest prefix that is a module, then attributes in it."""
    for entry in os.environ.get(CODE_PATH_ENV, "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not (module == e.name or module.startswith(f"{e.name}.")):
                raise  # the module exists and something it imports is missing: say that, not "no module"
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0])


def resolve(target: str) -> Callable[..., Any]:
    """A function by name; a class that has a ``forward`` stands for its ``forward`` (ESPnet3's runners are classes
    whose static ``forward(idx, dataset, model, **env)`` does the work)."""
    obj = resolve_object(target)
    forward = getattr(obj, "forward", None) if isinstance(obj, type) else None
    fn: Callable[..., Any] = forward if callable(forward) else obj
    return fn


def _build(made: Any, target: str) -> dict[str, Any]:
    """A provider's result as the environment mapping: a mapping as it is, or an ESPnet3-shaped provider object
    (``build_worker_setup_fn()`` returns the per-worker setup function; ``build_env_local()`` the environment)."""
    if isinstance(made, Mapping):
        return dict(made)
    for name in BUILDERS:
        build = getattr(made, name, None)
        if callable(build):
            made = build()() if name == "build_worker_setup_fn" else build()
            break
    if not isinstance(made, Mapping):
        raise TypeError(f"provider {target} gave a {type(made).__name__}: expected a mapping of names to objects, "
                        f"or a provider object with {'(), '.join(BUILDERS)}()")
    return dict(made)


def _config(value: Any) -> Any:
    """ESPnet3's providers read ``self.config.key``: a provider class gets its mapping arguments as OmegaConf
    configs when OmegaConf is installed (plain dicts otherwise)."""
    if not isinstance(value, Mapping):
        return value
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return value
    return OmegaConf.create(dict(value))


def environment(provider: dict[str, Any]) -> dict[str, Any]:
    """The provider's environment (dataset, model, ...), built once per worker and kept for every chunk.

    ``_target_`` is called with the other keys; it returns the environment mapping, or is a provider class (the
    seed's and ESPnet3's ``EnvironmentProvider`` shape, see ``_build``).
    """
    key = json.dumps(provider, sort_keys=True)
    if key not in _ENVS:
        if not provider:
            _ENVS[key] = {}
        else:
            target = provider["_target_"]
            make = resolve_object(target)
            kwargs = {k: (_config(v) if isinstance(make, type) else v) for k, v in provider.items() if k != "_target_"}
            _ENVS[key] = _build(make(**kwargs), target)
    return _ENVS[key]


def preload(targets: list[str]) -> Any:
    """A Dask worker plugin that imports the workload's modules when a worker starts, in the worker's main thread:
    tasks run in other threads, where a module that sets a signal handler on import (dask_jobqueue, which
    ESPnet3 imports) fails with "signal only works in main thread". A failure here is left to the task, which
    reports it."""
    from distributed import WorkerPlugin

    class Preload(WorkerPlugin):
        name = "runner-preload"

        def setup(self, worker: Any) -> None:
            for target in targets:
                with contextlib.suppress(Exception):
                    resolve_object(target)

    return Preload()


def quiet() -> None:
    """Silence Dask's own logging in this process: run on every worker (``Client.run``) once the driver gives up, so
    that the workers' complaints about the scheduler going away (tracebacks) do not bury runner's one error line."""
    logging.getLogger("distributed").setLevel(logging.CRITICAL + 1)


def run_chunk(provider: dict[str, Any], forward: str, items: list[int], retries: int
              ) -> tuple[dict[int, Any], dict[int, str], str | None]:
    """``forward(idx, **env)`` for each item; an item that raises is tried ``retries`` more times, then listed
    with its last error (one line). Returns (results, failed, None), or ({}, {}, error) when the workload cannot
    start here (the provider or ``forward`` fails to load or build): one error for the run, not one per item."""
    try:
        env, fn = environment(provider), resolve(forward)
    except Exception as e:  # the user's code
        return {}, {}, one_line(e)
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
    return results, failed, None


def run_reduce(reduce: str, run_dir: str) -> Any:
    """The workload's ``reduce`` over every item's value in item order, read from the (shared) run directory.

    It runs in a worker: it may need torch, which the driver never imports."""
    return resolve(reduce)(v for _, v in Store(RunDir(Path(run_dir))).items())
