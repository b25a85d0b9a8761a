"""ESPnet3's ``parallel:`` layer: a workload (provider + ``forward(idx, **env)``) over items, on Dask.

``plan`` (pure: chunks, workload hash, cluster arguments), ``store`` (the run directory's results, one file per
chunk, written atomically: what makes a rerun skip done items), ``run`` (the Dask driver behind ``runner
parallel``, on the login node) and ``worker`` (what runs inside each Dask worker). Only ``run`` and ``worker``
import Dask, and only when a workload runs: ``runner --help``, ``validate`` and ``submit`` never do.
"""
