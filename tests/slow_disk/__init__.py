"""A slow disk for tests, injected from outside runner: see sitecustomize.py here for what it does and does not
reproduce."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent


def env(at_step: int, seconds: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (os.environ by default) for a run whose rank 0 holds every checkpoint of step >= `at_step` for
    `seconds` between writing its files and publishing it. The ranks inherit it: a local run's from the CLI, a
    Slurm job's from sbatch's environment (srun passes it on)."""
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(HERE), base.get("PYTHONPATH", "")) if p)
    return {**base, "PYTHONPATH": path, "RUNNER_SLOW_DISK": f"{at_step}:{seconds:g}"}
