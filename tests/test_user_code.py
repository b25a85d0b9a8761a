"""User code in the job: targets imported before training, the real global batch measured, resume exactness said.

Real local runs in tests/test_user_code_local.py (2 processes, gloo DDP on CPU) of Lightning's own BoringModel +
BoringDataModule, which take none of runner's ``dataloader`` settings and train on a plain DataLoader (issue 13,
"Your own model").
"""

from __future__ import annotations

import functools

import pytest
import torch

from runner.job import honesty, targets

pytestmark = pytest.mark.unit


def test_batch_len_and_resumable() -> None:
    assert honesty.batch_len(torch.zeros(3, 2)) == 3
    assert honesty.batch_len({"x": [torch.zeros(5)], "n": 1}) == 5
    assert honesty.batch_len("text") is None
    assert not honesty.resumable(torch.utils.data.DataLoader(range(4)))
    from runner.dev.example import ShardLoader
    assert honesty.resumable(ShardLoader.__new__(ShardLoader))


class _Factory:
    def build_iter(self, epoch: int) -> list[int]:
        return [epoch]


_Factory.__module__ = "espnet2.iterators.sequence_iter_factory"  # as espnet2's iter factories are named


class EpochSyncIterator:
    """ESPnet3's class as runner recognizes it: its name, its package, the source DataLoaderBuilder gives it."""

    def __init__(self, source: object) -> None:
        self._source = source


EpochSyncIterator.__module__ = "espnet3.components.data.epoch_sync_iterator"


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def _loader(**kw: object) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(range(8), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("loader", "how"), [
    (_loader(), honesty.REPLAYED),  # in order
    (_loader(batch_size=2, shuffle=True), honesty.EPOCH_START),  # a RandomSampler: its order drawn when it starts
    (_loader(sampler=torch.utils.data.DistributedSampler(range(8), num_replicas=2, rank=0)), honesty.REPLAYED),
    (_loader(batch_sampler=[[0, 1], [2, 3]]), honesty.REPLAYED),  # a fixed list of batches
    (torch.utils.data.DataLoader(_Stream()), honesty.EPOCH_START),
    (EpochSyncIterator(functools.partial(_Factory().build_iter, 3)), honesty.REPLAYED),  # ESPnet3's, seeded by epoch
    (EpochSyncIterator([[0], [1]]), honesty.EPOCH_START),  # over a plain iterable: not known to be
    ([_loader(), _loader()], honesty.REPLAYED),
    ({"a": _loader(), "b": _loader(shuffle=True)}, honesty.EPOCH_START),
    (iter(range(3)), honesty.EPOCH_START),
], ids=["sequential", "random", "distributed", "batch-list", "iterable-dataset", "espnet3", "espnet3-plain-source",
        "two-in-order", "one-random-of-two", "an-iterator"])
def test_how_a_resume_positions_each_kind_of_loader(loader: object, how: str) -> None:
    got, why = honesty.positioning(loader)
    assert got == how and why and "\n" not in why, why


def test_a_loader_that_saves_its_position_is_restored_by_lightning() -> None:
    from runner.dev.example import ShardLoader
    assert honesty.positioning(ShardLoader.__new__(ShardLoader))[0] == honesty.RESTORED


def test_target_import_problem_is_one_line() -> None:
    assert targets.problem("runner.dev.example.TinyRegressor") is None
    assert "cannot import nowhere_pkg" in (targets.problem("nowhere_pkg.Data") or "")
    assert "has no class or function 'Nope'" in (targets.problem("runner.dev.example.Nope") or "")
