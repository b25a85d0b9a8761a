"""The non-finite guard with real Lightning training: a NaN never reaches the weights or a checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from runner.dev.example import ShardedDataModule, TinyRegressor  # noqa: E402
from runner.job.guards import FEW, NonFiniteGuard, buckets, nonfinite  # noqa: E402
from runner.rundir import RunDir  # noqa: E402

# Lightning 2.6 itself trips a FutureWarning of torch's pytree when it trains in-process.
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def _fit(tmp_path: Path, action: str, faults: dict, max_skips: int = 10) -> tuple[object, TinyRegressor, RunDir]:
    rd = RunDir(tmp_path)
    guard = NonFiniteGuard(rd, action, max_skips)
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
    ([3e38, 3e38], False),  # finite, but their sum overflows too
    ([1.0, float("nan")], True),
    ([float("inf"), 1.0], True),
    ([-float("inf"), 3e38], True),
])
@pytest.mark.parametrize("many", [False, True], ids=["few: sums", "many: fused norms"])
def test_nonfinite_is_true_only_for_a_nan_or_an_inf(values: list[float], bad: bool, many: bool) -> None:
    grads = [torch.ones(4, 4)] * (FEW if many else 1) + [torch.tensor(values)]
    assert nonfinite(grads) is bad
    assert nonfinite([]) is False


@pytest.mark.parametrize("many", [False, True], ids=["few: sums", "many: fused norms"])
def test_a_sparse_gradient_is_checked_by_its_values(tmp_path: Path, many: bool) -> None:
    """nn.Embedding(sparse=True) gives a sparse gradient: no storage to find buckets in, no dense norm kernel."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    params = [emb.weight] + [torch.nn.Parameter(torch.zeros(2)) for _ in range(FEW if many else 1)]
    for p in params[1:]:
        p.grad = torch.zeros(2)
    guard = NonFiniteGuard(RunDir(tmp_path), "stop", 0)
    trainer, optimizer = SimpleNamespace(strategy=None), SimpleNamespace(param_groups=[{"params": params}])
    assert guard._bad(trainer, optimizer, torch.device("cpu")) is False
    emb.weight.grad._values()[0, 0] = float("nan")
    assert guard._bad(trainer, optimizer, torch.device("cpu")) is True


def test_nonfinite_adds_half_precision_in_float32() -> None:
    """100k fp16 gradients of 1.0 add up past fp16's 65504: still finite, and no element-wise read is needed."""
    assert nonfinite([torch.ones(100_000, dtype=torch.float16)]) is False


def _views(sizes: list[int], buffer: int, offsets: list[int] | None = None) -> list[Any]:
    flat = torch.zeros(buffer)
    starts = offsets or [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[a:a + n] for a, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize(("grads", "read"), [
    pytest.param(lambda: _views([6, 3, 1], 10), [10], id="views tiling one buffer: one flat tensor"),
    pytest.param(lambda: _views([6, 4], 10) + _views([2, 2], 4), [10, 4], id="two buffers: two"),
    pytest.param(lambda: [torch.zeros(6), torch.zeros(4)], None, id="separate tensors: read themselves"),
    pytest.param(lambda: _views([6, 3], 10), None, id="a gap: another tensor's elements"),
    pytest.param(lambda: _views([6, 4], 10, [0, 5]), None, id="overlapping views"),
    pytest.param(lambda: [torch.zeros(3, 2).t(), torch.zeros(6)[0:0]], None, id="not contiguous"),
    pytest.param(lambda: [torch.zeros(2)[:1], torch.zeros(2, dtype=torch.float64)[1:]], None, id="one each"),
])
def test_buckets_are_read_only_where_the_gradients_cover_them_exactly(grads: Any, read: list[int] | None) -> None:
    tensors = grads()
    flats = buckets(tensors)
    assert (None if flats is None else [f.numel() for f in flats]) == read
    if flats is not None:  # the same memory: a NaN written into a gradient is in its bucket
        tensors[-1].view(-1)[0] = float("nan")
        assert nonfinite(flats) and not nonfinite(flats[:-1] if len(flats) > 1 else [])


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
    guard = NonFiniteGuard(rd, "stop", 10)
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
