"""runner: reproducible multi-node PyTorch Lightning training on Slurm."""

__version__ = "0.1.0"

# A plain program's one line (``runner.progress(step, loss=...)``): standard library only until called in a run.
from runner.steps import progress  # noqa: E402

__all__ = ["__version__", "progress"]
