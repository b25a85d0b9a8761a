"""The non-finite guard on real ranks (the local tier): FSDP2 shards and DDP buckets checked by every rank, one verdict
(the rest: tests/test_guards.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from runner.job.guards import NonFiniteGuard  # noqa: E402
from runner.rundir import RunDir  # noqa: E402
from tests.gloo_ranks import on_two_ranks  # noqa: E402

# Lightning 2.6 itself trips a FutureWarning of torch's pytree when it trains in-process.
pytestmark = [pytest.mark.local, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def _verdicts(rank: int, case: str) -> tuple[bool, list[int]]:
    """This rank's verdict, and which of the two parameters it read."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from runner.job import guards

    guards.SHARD_ABOVE = 4 if case == "ddp, split" else 1 << 24
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.ones(4)
    if case == "fsdp" or case == "ddp, small":  # a NaN in rank 1's gradients alone (FSDP: its shard)
        params[0].grad[0] = float("nan") if rank == 1 else 1.0
    else:  # DDP's reduced gradients, the same on both ranks: a NaN in the one rank 1 checks
        params[1].grad[0] = float("nan")
    trainer = SimpleNamespace(strategy=FSDPStrategy() if case == "fsdp" else DDPStrategy())
    guard = NonFiniteGuard(RunDir(Path("/nonexistent")), "stop", 0)
    bad = guard._bad(trainer, SimpleNamespace(param_groups=[{"params": params}]), torch.device("cpu"))
    return bad, [i for i, p in enumerate(params) if any(p is q for q in guard.plan[1])]


def _fsdp2_verdicts(rank: int, case: str) -> tuple[bool, list[int]]:
    """FSDP2 (runner's fsdp: Lightning's ModelParallelStrategy): parameters and gradients are DTensors sharded
    over the two ranks; a NaN in rank 1's local shard of the first gradient only (or in none)."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)])) for _ in range(2)]
    for p in params:
        p.grad = distribute_tensor(torch.ones(8), mesh, [Shard(0)])
    if case == "nan in rank 1's shard" and rank == 1:
        params[0].grad.to_local()[0] = float("nan")
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    guard = NonFiniteGuard(RunDir(Path("/nonexistent")), "stop", 0)
    bad = guard._bad(trainer, SimpleNamespace(param_groups=[{"params": params}]), torch.device("cpu"))
    return bad, [i for i, p in enumerate(params) if any(p is q for q in guard.plan[1])]


@pytest.mark.parametrize(("case", "expected"), [
    ("nan in rank 1's shard", {0: (True, [0, 1]), 1: (True, [0, 1])}),  # rank 0's shard is finite: it learns
    ("finite", {0: (False, [0, 1]), 1: (False, [0, 1])}),                 # of the NaN from the one all-reduce
])
def test_fsdp2_ranks_check_their_local_shards_and_share_one_verdict(case: str, expected: dict) -> None:
    assert on_two_ranks(_fsdp2_verdicts, case) == expected


@pytest.mark.parametrize(("case", "expected"), [
    # FSDP's ranks hold different shards: one all-reduce of the verdicts makes a NaN in one shard every rank's
    # decision (else that rank alone would stop, and the others wait in their next collective).
    ("fsdp", {0: (True, [0, 1]), 1: (True, [0, 1])}),
    # DDP, small: each rank reads all of its (reduced, identical) gradients and decides alone, no collective;
    # the different gradients here show that no verdict is shared.
    ("ddp, small", {0: (False, [0, 1]), 1: (True, [0, 1])}),
    # DDP above SHARD_ABOVE: each rank reads its share, and rank 0 learns of the NaN only from rank 1's verdict.
    ("ddp, split", {0: (True, [0]), 1: (True, [1])}),
])
def test_the_ranks_decide_alike_reading_their_share(case: str, expected: dict[int, tuple[bool, list[int]]]) -> None:
    assert on_two_ranks(_verdicts, case) == expected


def _ddp_reads(rank: int, case: str) -> tuple[bool, bool, list[int]]:
    """A real DDP's reduced gradients, checked before and after a NaN lands in one of them: the verdicts, and the
    sizes of what the guard read when it found the NaN."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=case == "bucket views")
    ddp(torch.randn(8, 16)).sum().backward()
    params = list(model.parameters())
    guard = NonFiniteGuard(RunDir(Path("/nonexistent")), "stop", 0)
    trainer, optimizer = SimpleNamespace(strategy=DDPStrategy()), SimpleNamespace(param_groups=[{"params": params}])
    clean = guard._bad(trainer, optimizer, torch.device("cpu"))
    params[2].grad.view(-1)[5] = float("nan")
    return clean, guard._bad(trainer, optimizer, torch.device("cpu")), [t.numel() for t in guard.views[1] or []]


@pytest.mark.parametrize(("case", "read"), [
    ("bucket views", [32 + 1 + 16 * 32 + 32]),  # runner's DDP: the one bucket, whole (the layout DDP gives)
    ("copies", []),  # Lightning's default DDP: the gradients themselves
])
def test_with_ddp_the_guard_reads_the_buckets_the_gradients_are_views_into(case: str, read: list[int]) -> None:
    assert on_two_ranks(_ddp_reads, case) == {0: (False, True, read), 1: (False, True, read)}
