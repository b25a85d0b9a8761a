"""Where a resumed epoch continues, checked against the installed Lightning: the private loop state runner reads and
moves (``runner.job.internals``) for a checkpoint written after an epoch's end or its validation (``epoch_end_follows``,
``epoch_batches_done``), a loader replayed to a stop's batch (``skip_batches``) and the next epoch's pass made from the
checkpoint's RNG (``begin_epoch_pass``). Runs of Lightning in this process, one rank, no runner."""

from __future__ import annotations

from pathlib import Path

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from lightning.pytorch.callbacks import Checkpoint  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from runner.job import internals  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


class _Held(L.LightningModule):
    """Records, by epoch, the value of each (one-sample) batch it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.held: dict[int, list[float]] = {}

    def training_step(self, batch: object, batch_idx: int) -> object:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        self.held.setdefault(self.current_epoch, []).append(float(x.flatten()[0]))  # type: ignore[union-attr]
        return self.layer(x).sum()

    def validation_step(self, batch: object, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> object:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Unsized:
    """An iterable with no length (ESPnet3's loader over espnet2's chunk factory): Lightning reads a batch ahead."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([torch.full((1, 1), float(i)) for i in range(8)])


def _fit_held(module: L.LightningModule, data: object, callbacks: list[L.Callback], tmp_path: Path,
         ckpt: Path | None = None, **trainer: object) -> L.Trainer:
    t = L.Trainer(**{"max_epochs": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                     "enable_model_summary": False, "accelerator": "cpu", "devices": 1, "callbacks": callbacks,
                     "default_root_dir": str(tmp_path), "num_sanity_val_steps": 0, **trainer})
    try:
        t.fit(module, train_dataloaders=data, ckpt_path=ckpt)
    except SIGTERMException:
        pass
    return t


class _StopAfter(L.Callback):
    """Saves where runner's checkpoint callback does (on_train_batch_end) and ends the fit as runner's stop does."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise SIGTERMException


class _Replay(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.taken = internals.skip_batches(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.ready)


@pytest.mark.parametrize("sized", [True, False], ids=["dataloader", "unsized"])
def test_a_loader_replayed_to_the_stops_batch_trains_the_rest_of_the_epoch_once(tmp_path: Path, sized: bool) -> None:
    """``skip_batches`` in on_train_start, resumed after batch 3 of 8: Lightning trains batches 3..7, the loader's
    pass positioned under its fetcher (read ahead for an unsized one). Lightning alone would start the pass again
    under its count of 3 and train batches 0..4."""
    def data() -> object:
        return torch.utils.data.DataLoader(torch.arange(8.0).view(8, 1), batch_size=1) if sized else _Unsized()

    saved = tmp_path / "stop.ckpt"
    _fit_held(_Held(), data(), [_StopAfter(saved, 3)], tmp_path)
    replay, resumed = _Replay(), _Held()
    _fit_held(resumed, data(), [replay], tmp_path, saved)
    assert replay.taken == 3 and resumed.held == {0: [3.0, 4.0, 5.0, 6.0, 7.0]}


class _EpochEvents(L.Callback):
    def __init__(self) -> None:
        self.follows: list[int] = []
        self.ended: list[tuple[int, bool]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if internals.epoch_end_follows(trainer):
            self.follows.append(batch_idx)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.ended.append(internals.epoch_batches_done(trainer))


def test_the_batches_after_which_lightning_validates_or_ends_the_epoch_are_known_at_their_end(tmp_path: Path) -> None:
    events = _EpochEvents()
    data = torch.utils.data.DataLoader(torch.arange(8.0).view(8, 1), batch_size=1)
    t = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[events], val_check_interval=3,
                  num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    t.fit(_Held(), train_dataloaders=data, val_dataloaders=torch.utils.data.DataLoader(torch.zeros(2, 1)))
    assert events.follows == [2, 5, 7]  # validations after batches 3 and 6, the epoch's end after 8
    assert events.ended == [(8, True)]


class _StopAtEpochEnd(Checkpoint):
    """Saves where runner's ``AfterEpochEnd`` does (the last checkpoint callback's on_train_epoch_end), with the RNG."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)
            torch.save(torch.get_rng_state(), self.path.with_suffix(".rng"))
            raise SIGTERMException


class _NextPass(L.Callback):
    def __init__(self, rng: Path) -> None:
        self.rng = rng

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.set_rng_state(torch.load(self.rng))
        self.made = internals.begin_epoch_pass(trainer)


def test_a_resume_at_an_epochs_end_makes_the_next_epochs_pass_from_the_checkpoints_rng(tmp_path: Path) -> None:
    """A RandomSampler draws its epoch's order when its pass begins: made after the RNG is restored, the next epoch
    is the uninterrupted run's."""
    def data() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.arange(8.0).view(8, 1), batch_size=1, shuffle=True)

    torch.manual_seed(0)
    whole = _Held()
    _fit_held(whole, data(), [], tmp_path, max_epochs=2)
    torch.manual_seed(0)
    saved = tmp_path / "epoch-end.ckpt"
    _fit_held(_Held(), data(), [_StopAtEpochEnd(saved)], tmp_path, max_epochs=2, enable_checkpointing=True)
    torch.manual_seed(1)  # another process
    after, resumed = _NextPass(saved.with_suffix(".rng")), _Held()
    _fit_held(resumed, data(), [after], tmp_path, saved, max_epochs=2)
    assert after.made and resumed.held == {1: whole.held[1]} and whole.held[1] != whole.held[0]
