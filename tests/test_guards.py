"""The non-finite guard with real Lightning training: a NaN never reaches the weights or a checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from runner.dev.example import ShardedDataModule, TinyRegressor  # noqa: E402
from runner.job.guards import make_guard, nonfinite  # noqa: E402
from runner.rundir import RunDir  # noqa: E402
from tests.gloo_ranks import on_two_ranks  # noqa: E402

# Lightning 2.6 itself trips a FutureWarning of torch's pytree when it trains in-process.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


def _fit(tmp_path: Path, action: str, faults: dict, max_skips: int = 10) -> tuple[object, TinyRegressor, RunDir]:
    rd = RunDir(tmp_path)
    guard = make_guard(rd, action, max_skips)
    model = TinyRegressor(lr=0.005, faults=faults)  # stable: only the injected NaN
    trainer = L.Trainer(max_steps=20, callbacks=[guard], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}))
    return guard, model, rd


def _finite(model: TinyRegressor) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize(("values", "bad"), [
    ([1.0, -2.0], False),
    ([3e38, -3e38], False),  # finite, but their norm overflows to inf: confirmed element by element
    ([1.0, float("nan")], True),
    ([float("inf"), 1.0], True),
    ([-float("inf"), 3e38], True),
])
def test_nonfinite_is_true_only_for_a_nan_or_an_inf(values: list[float], bad: bool) -> None:
    grads = [torch.ones(4, 4), torch.tensor(values)]
    assert nonfinite(grads) is bad
    assert nonfinite([]) is False


def test_stop_keeps_the_weights_finite_and_names_the_step(tmp_path: Path) -> None:
    guard, model, rd = _fit(tmp_path, "stop", {"nan_at_step": 7})
    assert guard.tripped_at == 7
    assert _finite(model)
    assert [(e["event"], e["step"], e["what"]) for e in rd.events()] == [("nonfinite", 7, "loss nan")]


def test_skip_drops_the_batch_and_trains_to_the_end(tmp_path: Path) -> None:
    guard, model, rd = _fit(tmp_path, "skip", {"nan_at_step": 7})
    assert guard.tripped_at is None
    assert _finite(model)
    assert [(e["event"], e["step"]) for e in rd.events()] == [("nonfinite_skipped", 7)]


def test_without_the_guard_the_nan_reaches_the_weights(tmp_path: Path) -> None:
    model = TinyRegressor(lr=0.005, faults={"nan_at_step": 7})
    trainer = L.Trainer(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}))
    assert not _finite(model)  # what the guard prevents: the test above would pass vacuously otherwise


class NaNFrom40(TinyRegressor):
    """A model broken for good from step 40 on (after the scale below settled): every loss from then on is NaN."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= 40 else loss


@pytest.mark.parametrize("broken", [False, True])
def test_fp16_gradscaler_overflows_are_left_to_the_scaler_and_a_streak_stops(tmp_path: Path, broken: bool) -> None:
    """A real GradScaler on the CPU, started at 2^30 so that its first steps overflow fp16, as 2^16 does on a GPU:
    the scaler skips them and halves its scale, and the guard does not stop the run for them (it once stopped
    every fp16 run at its first overflow). A model broken for good still stops, after SCALER_STREAK steps."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from runner.job.guards import SCALER_STREAK

    rd = RunDir(tmp_path)
    guard = make_guard(rd, "stop", 10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    model = (NaNFrom40 if broken else TinyRegressor)(lr=0.005)
    trainer = L.Trainer(max_steps=100, callbacks=[guard], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(model, datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}))
    assert _finite(model)
    if broken:
        assert guard.tripped_at == 40 + SCALER_STREAK
        assert [(e["event"], e["step"]) for e in rd.events()] == [("nonfinite", 40 + SCALER_STREAK)]
        return
    assert scaler.get_scale() < 2.0**30  # the first steps did overflow
    assert guard.tripped_at is None and trainer.global_step == 100 and rd.events() == []


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
    guard = make_guard(RunDir(Path("/nonexistent")), "stop", 0)
    bad = guard._bad(trainer, SimpleNamespace(param_groups=[{"params": params}]), torch.device("cpu"))
    return bad, [i for i, p in enumerate(params) if any(p is q for q in guard.plan[1])]


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
