"""The example ``parallel`` workload: feature statistics over the quickstart's data, the shape of ESPnet's
``collect_stats`` (each item's shape, sum and sum of squares; mean and standard deviation over all items).

``provider`` builds the dataset once per worker, ``forward(idx, **env)`` runs per item, ``reduce`` combines the
per-item values in item order (so the parallel result equals a plain loop's, float for float). ``sleep_s``,
``fail`` and ``flaky`` stand in for slow items and for items that fail always or once (tests, demos).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch


def provider(num_samples: int = 10000, dim: int = 16, data_seed: int = 0, frames: int = 8, sleep_s: float = 0.0,
             fail: list[int] | None = None, flaky: list[int] | None = None) -> dict[str, Any]:
    """The dataset: ``num_samples`` utterances of ``frames`` x ``dim`` features, from a fixed seed."""
    g = torch.Generator().manual_seed(data_seed)
    feats = torch.randn(num_samples, frames, dim, generator=g)
    return {"feats": feats, "sleep_s": sleep_s, "fail": set(fail or ()), "flaky": set(flaky or ()), "seen": set()}


def forward(idx: int, feats: torch.Tensor, sleep_s: float = 0.0, fail: AbstractSet[int] = frozenset(),
            flaky: AbstractSet[int] = frozenset(), seen: set[int] | None = None, **_: Any) -> dict[str, Any]:
    """One item's statistics (what collect_stats writes per utterance: its shape, feature sums)."""
    if sleep_s:
        time.sleep(sleep_s)
    if idx in fail:
        raise ValueError(f"item {idx} is broken")
    if idx in flaky and seen is not None and idx not in seen:  # fails on its first try in a worker, then works
        seen.add(idx)
        raise OSError(f"item {idx}: transient read error")
    x = feats[idx].double()
    return {"shape": list(x.shape), "sum": x.sum(0).tolist(), "sumsq": (x * x).sum(0).tolist()}


class StatsProvider:
    """The seed's provider class (ESPnet3's ``EnvironmentProvider`` shape, without ESPnet3): ``config`` holds
    ``provider``'s arguments; each worker builds the dataset once from ``build_worker_setup_fn()``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config

    def build_env_local(self) -> dict[str, Any]:
        return provider(**dict(self.config))

    def build_worker_setup_fn(self) -> Callable[[], dict[str, Any]]:
        config = dict(self.config)
        return lambda: provider(**config)


class StatsRunner:
    """The seed's runner class (ESPnet3's ``BaseRunner`` shape): a static ``forward``, and
    ``StatsRunner(provider)(range(n))`` runs it over the items here, in one process (the plain loop)."""

    def __init__(self, env_provider: StatsProvider) -> None:
        self.provider = env_provider

    @staticmethod
    def forward(idx: int, **env: Any) -> dict[str, Any]:
        return forward(idx, **env)

    def __call__(self, items: Iterable[int]) -> list[dict[str, Any]]:
        env = self.provider.build_env_local()
        return [self.forward(i, **env) for i in items]


def reduce(values: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation per feature dimension, and the frame count, over every item."""
    frames, total, totalsq = 0, None, None
    for v in values:
        frames += v["shape"][0]
        total = v["sum"] if total is None else [a + b for a, b in zip(total, v["sum"], strict=True)]
        totalsq = v["sumsq"] if totalsq is None else [a + b for a, b in zip(totalsq, v["sumsq"], strict=True)]
    if not frames or total is None or totalsq is None:
        return {"frames": 0, "mean": [], "std": []}
    mean = [t / frames for t in total]
    std = [math.sqrt(max(s / frames - m * m, 0.0)) for s, m in zip(totalsq, mean, strict=True)]
    return {"frames": frames, "mean": mean, "std": std}
