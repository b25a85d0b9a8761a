"""Every private part of torch and Lightning that runner uses (runner.job.internals) still exists in the installed
versions: a new torch or Lightning fails here, by name, not in a rank's log."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from runner import checkpoint  # noqa: E402
from runner.dev.example import ShardedDataModule, TinyRegressor  # noqa: E402
from runner.job import internals, watchdog  # noqa: E402
from runner.spec import schema  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def test_the_checkpoint_snapshot_has_the_layout_the_data_position_move_reads(tmp_path: Path) -> None:
    """``snapshot`` (Lightning's checkpoint connector) and ``move_epoch_position`` (its loops' saved layout)."""
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=str(tmp_path))
    trainer.fit(TinyRegressor(), datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}))
    buffers: list[object] = []
    ckpt = internals.snapshot(trainer, buffers)
    assert ckpt is not None and "state_dict" in ckpt and buffers
    fit = ckpt["loops"]["fit_loop"]
    assert len(fit["state_dict"]["combined_loader"]) == 1
    assert fit["epoch_loop.batch_progress"]["current"]["ready"] == 3
    shards, meta = internals.sharded_snapshot(trainer)
    assert set(shards) == {"state_dict", "optimizer_0"} and "loops" in meta


def test_the_guards_sparse_values_and_fused_norms() -> None:
    grad = torch.sparse_coo_tensor([[0, 2]], [3.0, 4.0], (4,))
    assert internals.sparse_values(grad).tolist() == [3.0, 4.0]
    assert [float(n) for n in internals.norms([torch.tensor([3.0, 4.0]), torch.zeros(2)])] == [5.0, 0.0]


def test_a_process_groups_timeout_can_be_set_after_it_was_built() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        internals.set_pg_timeout(60)
    finally:
        dist.destroy_process_group()


def test_the_fixed_bucket_ddp_overrides_and_calls_what_torch_and_lightning_have() -> None:
    assert internals.fixed_buckets_missing(DistributedDataParallel, dist.Reducer) == []
    overridden = {name for cls in (internals.ReadyOrderDDP, internals.FixedBucketsDDP) for name in vars(cls)
                  if name.startswith("_") and not name.startswith("__")}
    assert overridden and all(hasattr(DistributedDataParallel, n) or hasattr(DDPStrategy, n) for n in overridden)
    assert isinstance(DDPStrategy()._ddp_kwargs, dict)  # what fix_bucket_layout reads and the override passes on
    strategy = DDPStrategy()
    assert internals.fix_bucket_layout(strategy) == "fixed bucket layout"
    assert type(strategy) is internals.FixedBucketsDDP


def test_the_sharded_checkpoints_files_are_named_as_runner_expects(tmp_path: Path) -> None:
    """DCP's index and shard names (``checkpoint.verify``, ``write_digests``) and Lightning's name for the rest."""
    internals.dcp_save({"state_dict": {"w": torch.zeros(3)}}, tmp_path, None)
    assert (tmp_path / checkpoint.CheckpointDir.DCP_INDEX).is_file()
    checkpoint.write_digests(tmp_path, 0)  # finds this rank's one shard
    assert checkpoint.CheckpointDir.meta(tmp_path).name == internals.META


@pytest.mark.parametrize("mark", [*watchdog.COLLECTIVE_FRAMES, *watchdog.DATA_FRAMES])
def test_the_watchdogs_private_frames_are_this_torchs(mark: str) -> None:
    if mark.endswith(".py:"):
        assert any(p.name == mark[:-1] for p in Path(torch.__file__).parent.rglob(mark[:-1]))
        return
    loader_iter = type(iter(torch.utils.data.DataLoader([0])))
    assert any(hasattr(owner, mark.lstrip(":")) for owner in (DistributedDataParallel, loader_iter)), mark


def test_the_watchdogs_torch_paths_are_this_torchs() -> None:
    site = Path(torch.__file__).parent.parent
    paths = [m.rstrip(":") for _, marks in watchdog.PHASES for m in marks if m.startswith("torch/")]
    assert paths and all((site / p).exists() for p in paths), paths


class _Counting(L.LightningModule):
    """Counts the batches it trains in each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.batches: dict[int, int] = {}

    def training_step(self, batch: list[object], batch_idx: int) -> object:
        self.batches[self.current_epoch] = self.batches.get(self.current_epoch, 0) + 1
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> object:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _SaveAtEpochEnd(L.Callback):
    """Saves where runner's checkpoint callback does: on_train_batch_end, here of the first epoch's last batch."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.current_epoch == 0 and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            trainer.save_checkpoint(self.path)


class _Whole(L.Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        internals.start_next_epoch_whole(trainer)


@pytest.mark.parametrize("whole, second_epoch", [(False, 8), (True, 16)], ids=["lightning-alone", "runner"])
def test_a_resume_at_an_epochs_end_onto_longer_epochs_starts_the_next_epoch_whole(tmp_path: Path, whole: bool,
                                                                                   second_epoch: int) -> None:
    """Saved at the last of 8 batches (2 ranks' share of a plain DataLoader), resumed where an epoch has 16 (1 rank):
    Lightning alone carries the 8 into the next epoch, which ends after 8 batches; with ``start_next_epoch_whole`` in
    on_train_start it trains all 16 (ESPnet3's resume on fewer ranks at an epoch's end, tests/test_espnet3.py)."""
    def fit(batches: int, module: _Counting, callbacks: list[L.Callback], ckpt: Path | None) -> None:
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(batches, 2)), batch_size=1)
        trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks,
                            default_root_dir=str(tmp_path))
        trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt)

    saved = tmp_path / "epoch-end.ckpt"
    fit(8, _Counting(), [_SaveAtEpochEnd(saved)], None)
    resumed = _Counting()
    fit(16, resumed, [_Whole()] if whole else [], saved)
    assert resumed.batches == {1: second_epoch}


class _LoadingSeen(L.Callback):
    """Whether the watch said "loading" while Lightning applied the checkpoint to the callbacks."""

    def __init__(self, watch: Any) -> None:
        self.watch, self.loading = watch, []

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.loading.append(self.watch.loading)


class _Watch:
    def __init__(self) -> None:
        self.loading, self.loaded_while = False, []

    def loaded(self) -> None:
        self.loaded_while.append(self.loading)


def _fit(tmp_path: Path, steps: int, watch: Any = None, callbacks: Any = (), ckpt: Path | None = None) -> Any:
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=list(callbacks),
                        default_root_dir=str(tmp_path))
    if watch is not None:
        internals.watch_restore(trainer, watch)
    trainer.fit(TinyRegressor(), datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}),
                ckpt_path=None if ckpt is None else str(ckpt))
    return trainer


def test_the_restore_is_watched_from_its_read_to_its_end_and_a_failed_load_stays_loading(tmp_path: Path) -> None:
    """``watch_restore`` (Lightning's checkpoint connector: runner.job.fallback's LoadWatch): loading while
    Lightning reads and applies the checkpoint, ``loaded`` after the restore's end; a load that raises leaves it
    loading and never says loaded."""
    good = tmp_path / "good.ckpt"
    _fit(tmp_path, 2).save_checkpoint(good)
    watch = _Watch()
    seen = _LoadingSeen(watch)
    assert _fit(tmp_path, 3, watch, [seen], good).global_step == 3
    assert seen.loading == [True] and watch.loaded_while == [False]
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    failing = _Watch()
    with pytest.raises(Exception, match="load"):
        _fit(tmp_path, 3, failing, ckpt=bad)
    assert failing.loading and failing.loaded_while == []


def test_precision_and_strategy_lists_match_installed_lightning() -> None:
    """runner.spec.schema's lists, which the CLI checks configs against without importing Lightning."""
    from lightning.fabric.connector import _PRECISION_INPUT
    from lightning.pytorch.strategies import StrategyRegistry

    accepted = {v for lit in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(lit)}
    assert set(schema.PRECISIONS) == accepted
    assert set(schema.STRATEGIES) <= set(StrategyRegistry.available_strategies())
