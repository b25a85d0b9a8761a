"""ESPnet3's ``parallel:`` layer: a workload (provider + ``forward(idx, **env)``) over items, on Dask.

``plan`` (pure: chunks, workload hash, cluster arguments), ``store`` (the run directory's results, one file per
chunk, written atomically: what makes a rerun skip done items) and ``worker`` (what runs inside each Dask
worker). The driver behind ``runner parallel`` runs on the login node: ``runner.host.parallel``. Only it and the
workers import Dask, and only when a workload runs: ``runner --help``, ``validate`` and ``submit`` never do.
"""
