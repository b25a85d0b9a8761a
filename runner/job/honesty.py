"""Say what the user's data module really does, measured in the job.

The config promises a global batch (``batch_size`` x ranks x accumulation) and bitwise-exact resumes, but both
depend on the data module: one that does not take ``dataloader`` builds its own loaders, and a loader that neither
saves its position nor repeats an epoch's order cannot resume in the middle of an epoch. This callback measures the
real global batch at the first step and says how a resume positions the train loader mid-epoch (``positioning``):
restored by Lightning (``state_dict``/``load_state_dict``, as torchdata's ``StatefulDataLoader`` and runner's example
loader do), replayed to the batch by runner (an epoch that is a function of the epoch: ESPnet3's loader, a DataLoader
in order or under a ``DistributedSampler``), or only at the epoch's start (runner then resumes from the newest
checkpoint at an epoch's end); rank 0 logs both and records them in one ledger event (``data``: ``exactness`` is
"exact" or "epoch boundaries only"), where ``runner status`` and a reader of the run directory find them.

A resume adds one ``resumed`` event (``Resumed``, a typed record made by ``resumed``, a pure function): what the
resume restored exactly and what it did not. On the same shape, the weights, the optimizer state, the RNG and the
data position are those of the checkpoint and the run continues bitwise. On another world size the weights and
the optimizer state are still exact (DDP loads the whole model; fsdp's DCP reshards every saved element into the
new shards, none recomputed), the trajectory is not bitwise (other sum orders, another accumulation, the RNG of
ranks that no longer exist). The data position kept is the step (so the global sample count, step x global batch,
with the global batch kept), the epoch, and the position in the epoch: when the train loader's state is a global
position (``global_batches`` taken by all ranks in the epoch and the ``world_size`` that took them, as runner's
example loader with ``order="global"`` saves it), Lightning's per-rank count is moved to global_batches / new world
size as the loader moves its own (``internals.move_epoch_position``), and the samples that follow are those the old
shape would have taken next (``data_exact``). Any other loader keeps Lightning's per-rank count: which samples follow
mid-epoch is then the new ranks' loaders' business, a count, not a set of samples (``data_exact`` false). At an
epoch boundary the next epoch starts whole.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import lightning as L

from runner import checkpoint
from runner.job import internals
from runner.records import CheckpointManifest
from runner.rundir import RunDir
from runner.spec.typed import RunConfig

log = logging.getLogger(__name__)
EXACT = "exact"
EPOCH_ONLY = "epoch boundaries only"
BITWISE = "bitwise"
RESHARDED = "resharded"


@dataclass(frozen=True)
class Resumed:
    """What a resume restored exactly, and what not: the ledger's ``resumed`` event (``asdict``)."""

    step: int  # the checkpoint's optimizer step: training continues at the next one
    epoch: int
    from_world: int  # the world size that wrote the checkpoint
    to_world: int
    from_accumulate: int | None  # None: a checkpoint from before runner recorded it
    to_accumulate: int
    global_batch: int | None  # samples per optimizer step, the same on both shapes (None: a program's own)
    samples: int | None  # the global sample count at the checkpoint: step x global batch
    epoch_batches: int | None  # batches each rank had taken in the epoch
    epoch_batches_now: int | None  # the count each rank goes on from: the same, or moved with a global position
    mid_epoch: bool
    state: str  # weights and optimizer state: "exact", or "resharded" (exact: every element loaded, fsdp's DCP)
    trajectory: str  # "bitwise", or why not
    data: str  # the data position kept, in words
    data_exact: bool  # the next sample is the one the uninterrupted run would have taken on the same shape
    # What becomes of the epoch the stop interrupted: "whole" (resumed at an epoch's end, nothing interrupted),
    # "restarted" (a newer mid-epoch checkpoint passed over: the epoch is trained again from its start, each batch
    # once; ``steps_again`` of its steps trained a second time), "exact" (continued at the next sample the
    # uninterrupted run would have taken), "counted" (another world size continues Lightning's per-rank count with
    # its own loaders: which samples follow is the new layout's), "twice and never" (the loader restarts its pass
    # while Lightning counts on: the pass's first batches trained again, as many of its last never)
    partial_epoch: str
    steps_again: int | None  # "restarted": the optimizer steps between the epoch's start and the passed-over one
    first_step_samples: int | None  # the first step's samples when the new accumulation cuts it short, else None

    @property
    def reshaped(self) -> bool:
        return self.from_world != self.to_world

    def fields(self) -> dict[str, Any]:
        return {**asdict(self), "reshaped": self.reshaped}


def resumed(manifest: CheckpointManifest, world: int, accumulate: int, global_batch: int | None, *, sharded: bool,
            exact_resume: bool, loader_resumable: bool,
            global_position: tuple[int, int, int] | None = None, replayed: bool = False,
            passed_over: int | None = None, layout_bound: bool = False) -> Resumed:
    """The honesty record of a resume from a checkpoint with this ``manifest`` onto ``world`` ranks (pure).
    ``global_position``: (batches of all ranks into the epoch, per rank before, per rank now) when the loader's
    position is a global one and was moved onto this world size (``internals.move_epoch_position``). ``replayed``:
    the loader's pass of the epoch was replayed to the checkpoint's batch (``loader_resumable`` then too).
    ``passed_over``: the step of a newer checkpoint, mid-epoch, not resumed because the loader cannot be positioned
    there (this one is at the epoch's start); ``layout_bound``: because the loader is replayed to a batch only on the
    layout that wrote it (``checkpoint.passes_over``), and this resume is on another."""
    step, epoch = int(manifest.get("step", 0)), int(manifest.get("epoch", 0))
    from_world = int(manifest.get("world_size", world))
    from_acc = manifest.get("accumulate")
    batches = manifest.get("epoch_batches")
    mid = bool(manifest.get("mid_epoch", True))
    reshaped = from_world != world
    state = RESHARDED if sharded and reshaped else EXACT
    if reshaped:
        trajectory = (f"not bitwise: {world} ranks sum the gradients in another order than {from_world}, with "
                      f"accumulation {accumulate} instead of {from_acc if from_acc is not None else '?'}, and the "
                      "dropout streams of other ranks")
    elif not exact_resume:
        trajectory = "not promised bitwise: checkpoint.exact_resume is false"
    elif mid and not loader_resumable:
        trajectory = "not bitwise: the train loader cannot restore its position mid-epoch (it restarts the epoch)"
    else:
        trajectory = BITWISE
    kept = f"step {step}" + (f" ({step * global_batch} samples at global batch {global_batch})"
                             if global_batch else "") + f", epoch {epoch}"
    short = None
    if not mid:
        data = f"{kept}, at the epoch's end: the next epoch starts whole"
        if passed_over is not None:
            why = (f"the loader is replayed to a batch only on the layout that wrote it ({from_world} ranks), not on "
                   f"{world}" if layout_bound else "the loader cannot be positioned mid-epoch")
            data += (f"; the newer checkpoint of step {passed_over}, mid-epoch, was passed over: {why}, so the "
                     f"interrupted epoch is trained again from its start, each batch once ({passed_over - step} steps "
                     "again)")
    elif not loader_resumable:
        data = (f"{kept}; the loader cannot resume mid-epoch: it replays the epoch from its start while Lightning "
                f"counts on from batch {batches if batches is not None else '?'}, so this epoch trains the replayed "
                "pass's first batches (those before that batch a second time) and never as many of its last")
    elif not reshaped:
        data = f"{kept}, {batches if batches is not None else '?'} batches per rank into the epoch: the same samples"
        if replayed:
            data += " (the epoch's pass replayed to that batch: its batches before it read again, not trained)"
    elif global_position is not None:
        done, before, now = global_position
        data = (f"{kept}, {done} batches of all ranks into the epoch, kept as a global position ({before} per rank "
                f"on {from_world} ranks, {now} per rank on {world}): the samples that follow are those the "
                f"{from_world} ranks would have taken next")
    else:
        data = (f"{kept}, {batches if batches is not None else '?'} batches per rank into the epoch kept as a count: "
                f"each of the {world} new ranks continues its own loader from that batch, so mid-epoch the samples "
                f"that follow are the new layout's (those the {from_world} old ranks had left in the epoch are not "
                "replayed in it)")
    count = global_position[2] if global_position and reshaped else batches  # where each rank counts on from
    if reshaped and mid and loader_resumable and isinstance(count, int) and count % accumulate and global_batch:
        short = (accumulate - count % accumulate) * global_batch // accumulate
    data_exact = not mid or (loader_resumable and (not reshaped or global_position is not None))
    partial = ("restarted" if passed_over is not None else "whole") if not mid else "exact" if data_exact else \
        "counted" if loader_resumable else "twice and never"
    return Resumed(step=step, epoch=epoch, from_world=from_world, to_world=world,
                   from_accumulate=int(from_acc) if isinstance(from_acc, int) else None, to_accumulate=accumulate,
                   global_batch=global_batch, samples=step * global_batch if global_batch else None,
                   epoch_batches=int(batches) if isinstance(batches, int) else None,
                   epoch_batches_now=int(count) if isinstance(count, int) else None, mid_epoch=mid, state=state,
                   trajectory=trajectory, data=data, data_exact=data_exact, first_step_samples=short,
                   partial_epoch=partial,
                   steps_again=passed_over - step if passed_over is not None and not mid else None)


def batch_len(batch: Any) -> int | None:
    """The leading dimension of the first tensor-like object in a batch (tuple, list, dict or tensor)."""
    if hasattr(batch, "shape") and len(batch.shape) >= 1:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_len(item)
        if n is not None:
            return n
    return None


def resumable(loader: Any) -> bool:
    """Whether Lightning can save and restore this loader's position mid-epoch (its ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


RESTORED = "restored"  # the loader saves and restores its own position: Lightning restores it
REPLAYED = checkpoint.REPLAYED  # each epoch's batches are a function of the epoch: runner replays the pass to the
# batch, on the layout that wrote the checkpoint (on another, a resume goes back to the epoch's start)
EPOCH_START = checkpoint.EPOCH_START  # neither: a resume mid-epoch goes back to the epoch's start


def positioning(loader: Any) -> tuple[str, str]:
    """How a resume continues the train loader (or each of several) mid-epoch, and why in words (pure: reads the
    loader's classes and settings, draws nothing). A loader that saves its position is restored by Lightning; one
    whose epoch is a function of the epoch is replayed to the batch (``internals.skip_batches``): ESPnet3's
    ``EpochSyncIterator`` over an espnet2 iter factory (each epoch's order seeded with epoch + seed, the sharded
    datasets' shard chosen by epoch and rank), and a DataLoader over a map-style dataset in order, in a fixed list of
    batches, or through a ``DistributedSampler`` (ordered by its seed and the epoch Lightning gives it). Anything else
    (a ``RandomSampler``, whose order comes from the RNG when the epoch starts; an ``IterableDataset``, a sampler runner
    does not know) is positioned at the epoch's start only."""
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)):
        kinds = [positioning(one) for one in loader]
        if all(k == RESTORED for k, _ in kinds) or all(k == REPLAYED for k, _ in kinds):
            return kinds[0] if kinds else (EPOCH_START, "no train loader")
        return EPOCH_START, "; ".join(why for k, why in kinds if k == EPOCH_START) or \
            "its loaders are not positioned alike"
    name = type(loader).__name__
    if resumable(loader):
        return RESTORED, f"{name} saves its position (state_dict/load_state_dict)"
    if name == "EpochSyncIterator" and type(loader).__module__.startswith("espnet3."):
        source = getattr(loader, "_source", None)  # DataLoaderBuilder's partial(iter_factory.build_iter, epoch)
        factory = getattr(getattr(source, "func", None), "__self__", None)
        if isinstance(source, functools.partial) and type(factory).__module__.startswith("espnet2.iterators."):
            return REPLAYED, (f"ESPnet3's {name} over espnet2's {type(factory).__name__}: each epoch's batches are "
                              "seeded with the epoch")
        return EPOCH_START, f"ESPnet3's {name} over {type(source).__name__}, not an espnet2 iter factory's epoch"
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

    if not isinstance(loader, DataLoader):
        return EPOCH_START, f"{name} is not a loader runner can position"
    if isinstance(loader.dataset, IterableDataset):
        return EPOCH_START, f"its dataset {type(loader.dataset).__name__} is iterable: its order is its own"
    batches = loader.batch_sampler
    if isinstance(batches, (list, tuple)):
        return REPLAYED, "a DataLoader over a fixed list of batches"
    sampler = batches.sampler if isinstance(batches, BatchSampler) else loader.sampler
    if isinstance(sampler, (SequentialSampler, DistributedSampler)) and \
            (batches is None or type(batches) is BatchSampler):
        return REPLAYED, f"a DataLoader with a {type(sampler).__name__}: each epoch's order is a function of the epoch"
    what = type(sampler).__name__ if type(batches) is BatchSampler else type(batches).__name__
    return EPOCH_START, f"a DataLoader with a {what}, whose order runner cannot replay"


def configured_batch(cfg: RunConfig, world: int) -> int | None:
    """The global batch the config asks for (runner's own mode), None in program mode (the program's own)."""
    batch = cast(dict[str, Any], cfg["dataloader"]["train"]).get("batch_size")
    return None if cfg.get("command") or batch is None else \
        int(batch) * world * cfg["trainer"]["accumulate_grad_batches"]


class Honesty(L.Callback):
    """A Lightning callback that measures and records; it changes nothing in training. ``configured``: the global
    batch the config asks for (None: a program's own, not known to runner). Before ``fit``, ``resuming(path)``
    names the checkpoint training continues from: rank 0 records its ``Resumed`` at the start of training.
    ``moved``: the data position the checkpoint callback moved onto this world size, if it did."""

    def __init__(self, rd: RunDir, configured: int | None, rank: int, world: int, exact_resume: bool = True,
                 moved: Callable[[], tuple[int, int, int] | None] = lambda: None,
                 replayed: Callable[[], bool] = lambda: False) -> None:
        self.rd, self.configured, self.rank, self.world = rd, configured, rank, world
        self.exact_resume, self.moved, self.replayed = exact_resume, moved, replayed
        self.exactness = ""
        self.measured = False
        self.resume_from: Path | None = None
        self.passed_over: int | None = None
        self.record: Resumed | None = None

    def resuming(self, path: Path, passed_over: int | None = None) -> None:
        """Before ``fit``: training continues from ``path``; ``passed_over``: a newer mid-epoch checkpoint's step,
        not taken (the loader cannot be positioned there)."""
        self.resume_from, self.passed_over = path, passed_over

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank, world, configured = self.rank, self.world, self.configured
        loader = trainer.train_dataloader
        how, why = positioning(loader)
        self.exactness = EPOCH_ONLY if how == EPOCH_START else EXACT
        if rank == 0:
            if how == EPOCH_START:
                log.warning("the train loader cannot be positioned mid-epoch (%s): a resume continues from the "
                            "epoch's start, exact only at epoch boundaries (runner checkpoints each epoch's end). "
                            "hint: torchdata's StatefulDataLoader, or a sampler seeded by the epoch "
                            "(DistributedSampler), can be positioned", why)
            elif how == REPLAYED:
                log.info("the train loader is replayed to its batch on a resume mid-epoch (%s)", why)
        if self.resume_from is None or rank != 0:
            return
        manifest = checkpoint.manifest_of(self.resume_from)
        self.record = resumed(manifest, world, trainer.accumulate_grad_batches, configured,
                              sharded=internals.is_sharded(trainer.strategy), exact_resume=self.exact_resume,
                              loader_resumable=how == RESTORED or self.replayed(), global_position=self.moved(),
                              replayed=self.replayed(), passed_over=self.passed_over,
                              layout_bound=how == REPLAYED and manifest.get("world_size", world) != world)
        r = self.record
        log.log(logging.WARNING if r.reshaped else logging.INFO,
                "resumed at step %d on %d ranks (the checkpoint's: %d): weights and optimizer state %s; "
                "trajectory %s; data: %s", r.step, r.to_world, r.from_world,
                "resharded, every saved element loaded" if r.state == RESHARDED else r.state, r.trajectory, r.data)
        if r.first_step_samples is not None:
            log.warning("the first step after the resume takes %d samples, not %s: the checkpoint fell "
                        "inside an accumulation of the new shape", r.first_step_samples, r.global_batch)
        self.rd.record("resumed", **r.fields())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        rank, world, configured = self.rank, self.world, self.configured
        if self.measured or rank != 0:
            return
        self.measured = True
        local = batch_len(batch)
        acc = trainer.accumulate_grad_batches
        real = None if local is None else local * world * acc
        log.log(logging.INFO if real == configured or configured is None else logging.WARNING,
                "global batch measured at the first step: %s = %s x %d ranks x %d accumulation%s", real, local,
                world, acc, f" (the config says {configured})" if configured is not None else "")
        self.rd.record("data", exactness=self.exactness, global_batch=real, configured_global_batch=configured,
                       local_batch=local)
