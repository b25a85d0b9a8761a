"""Development aids: the local multi-node Slurm cluster and the example model and data."""
