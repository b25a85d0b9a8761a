"""Code that runs on the login node or the batch host, never inside the container.

Submitting, talking to Slurm, the batch script's hooks, status, cron and image builds. Nothing here imports
torch or lightning (an import-linter contract checks it): the login node is not the image.
"""
