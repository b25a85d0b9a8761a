"""runner: reproducible multi-node PyTorch Lightning training on Slurm."""

__version__ = "0.1.0"
