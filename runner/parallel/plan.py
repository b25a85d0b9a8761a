"""The pure part of a parallel run: chunks, the workload's identity, each worker's setup, progress lines.

Nothing here touches the system, so every decision is a value a test can look at (``runner parallel
--dry-run`` prints them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runner.spec.parallel import OPTIONS
from runner.spec.typed import Parallel

CODE_PATH_ENV = "RUNNER_CODE_PATH"  # set by the driver for the workers: the config's directory (the workload)


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    stop: int

    @property
    def items(self) -> range:
        return range(self.start, self.stop)


def chunks(n_items: int, size: int) -> list[Chunk]:
    return [Chunk(i, start, min(start + size, n_items)) for i, start in enumerate(range(0, n_items, size))]


def workload_hash(par: Parallel) -> str:
    """What the results depend on (not where they are computed: env, n_workers and options may change between
    a run and its rerun). The run directory is named by it, so a rerun of the same workload continues it and
    another workload never mixes its results in."""
    keys = ("provider", "forward", "reduce", "items", "chunk_size")
    return hashlib.sha256(json.dumps({k: par[k] for k in keys}, sort_keys=True).encode()).hexdigest()[:12]  # type: ignore[literal-required]


def todo(chunk: Chunk, done: Mapping[int, Any]) -> list[int]:
    return [i for i in chunk.items if i not in done]


def worker_envs(env: str, n_workers: int, threads: int, gpus: Sequence[str]) -> list[dict[str, str]]:
    """Environment variables of each local worker process: ``local_gpu`` pins one visible GPU per worker."""
    base = {"OMP_NUM_THREADS": str(threads)}
    if env == "local_gpu":
        return [{**base, "CUDA_VISIBLE_DEVICES": g} for g in list(gpus)[:n_workers]]
    return [dict(base) for _ in range(n_workers)]


def slurm_kwargs(par: Parallel, slurm: Mapping[str, Any], *, job_name: str, log_dir: str, python: str,
                 prologue: list[str]) -> dict[str, Any]:
    """dask-jobqueue's SLURMCluster arguments: one worker process per job, the run's partition/account/time
    unless ``parallel.options`` says otherwise, the worker started by ``python`` (the image's, through the
    container runtime's exec prefix)."""
    defaults: dict[str, Any] = {"cores": 1, "memory": "1GB", "processes": 1, "walltime": str(slurm["time"])}
    if slurm.get("partition"):
        defaults["queue"] = slurm["partition"]
    if slurm.get("account"):
        defaults["account"] = slurm["account"]
    options = {k: v for k, v in par["options"].items() if k in OPTIONS["slurm"]}
    return {**defaults, **options, "job_name": job_name, "log_directory": log_dir, "python": python,
            "job_script_prologue": prologue}


def progress(done: int, total: int, failed: int, rate: float, width: int = 30) -> str:
    """``[#######.......]  7000/10000 items  1234/s  ETA 2s  3 failed``."""
    frac = done / total if total else 1.0
    bar = "#" * int(frac * width)
    eta = f"ETA {(total - done) / rate:.0f}s" if rate > 0 and done < total else ""
    fail = f"{failed} failed" if failed else ""
    return "  ".join(p for p in (f"[{bar:<{width}}]", f"{done}/{total} items", f"{rate:.0f}/s", eta, fail) if p)
