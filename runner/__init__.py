"""runner: reproducible multi-node PyTorch Lightning training on Slurm.

``import runner`` imports the standard library alone: it runs inside every rank. The Python API (``runner.submit``,
``runner.sweep``, ``runner.find``, ...: ``runner.api``) is imported the first time one of its names is used.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# A plain program's one line (``runner.progress(step, loss=...)``): standard library only until called in a run.
from runner.steps import progress  # noqa: E402

if TYPE_CHECKING:  # the API's names, for type checkers; at run time ``__getattr__`` imports them when first used
    from runner.api import (
        Event,
        Plan,
        Run,
        Sweep,
        SweepPlan,
        execute,
        find,
        find_sweep,
        plan,
        plan_sweep,
        runs,
        submit,
        sweep,
        validate,
    )

__all__ = ["Event", "Plan", "Run", "Sweep", "SweepPlan", "__version__", "execute", "find", "find_sweep", "plan",
           "plan_sweep", "progress", "runs", "submit", "sweep", "validate"]
_API = frozenset(__all__) - {"__version__", "progress"}


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module("runner.api"), name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
