"""Code that runs inside the allocation, in the container, one process per rank.

The launcher, checkpoints, the NCCL/gloo environment and the preflight checks. Nothing here imports
``runner.host`` (an import-linter contract checks it): the image may hold no Slurm client at all.
"""
