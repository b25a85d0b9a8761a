"""The Lightning callback that owns checkpoints: periodic, on signal, RNG per rank, ``COMPLETE`` last.

A checkpoint costs the training thread one copy of the state; serializing, writing, fsyncing and hashing happen in a
background thread (``checkpoint.Writer``), one checkpoint at a time. It also stops training at the step all ranks
agree on (``Agreement``) and keeps ``progress.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from runner import __version__, checkpoint
from runner.checkpoint import CheckpointDir
from runner.job import honesty, internals, owner, rng, watchdog
from runner.job.agreement import STOP, SUPERSEDED, Agreement
from runner.job.guards import NonFiniteGuard
from runner.job.stopflag import StopFlag
from runner.records import CheckpointManifest
from runner.rundir import RunDir, atomic_write, number, read_json
from runner.spec.typed import RunConfig

log = logging.getLogger("runner.job.callback")  # rank logs name these lines runner's callback's, as before the split

PROGRESS_S = 2.0  # progress.json is rewritten at most this often (and at every checkpoint)


def save(obj: Any, path: Path, sync_dir: bool = True) -> None:
    """torch.save straight into the file: serializing into memory first held the GIL twice as long (measured: a
    400 MB checkpoint took 0.57 s instead of 0.30 s, and the training thread got 70% of its time instead of 92%)."""
    atomic_write(path, lambda f: torch.save(obj, f), sync_dir=sync_dir)


def _loss(outputs: Any) -> float | None:
    """The training step's loss as a number (what ``training_step`` returned), None where it returned none."""
    loss: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        value = float(loss.item() if hasattr(loss, "item") else loss)
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


def adopt_last_checkpoints(trainer: L.Trainer, rd: RunDir) -> None:
    """On a resume: a ModelCheckpoint of the program's that keeps ``last.ckpt`` (``save_last``) and had saved none
    when runner's checkpoint was taken (its restored ``last_model_path`` is empty), while a ``last.ckpt`` of this run
    is there (an attempt wrote it after that checkpoint), overwrites that file instead of writing ``last-v1.ckpt``
    beside it: Lightning versions a ``last.ckpt`` it does not know as another run's. One written before this run was
    submitted is left to Lightning's versioning."""
    created = float((rd.manifest_record() or {}).get("created") or 0.0)
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.save_last or callback.last_model_path \
                or "{" in callback.CHECKPOINT_NAME_LAST or not callback.dirpath:
            continue
        last = os.path.join(callback.dirpath, f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")  # its name
        try:
            written = os.lstat(last).st_mtime
        except OSError:
            continue
        if written >= created:
            callback.last_model_path = last
            log.info("the program's %s is this run's (written after it was submitted): it is kept up to date, "
                     "not versioned", last)


class RunnerCheckpoint(L.Callback):
    """Checkpoints every ``checkpoint.every_n_steps`` steps and at the agreed stop step; resumes the RNG and the
    data position of the checkpoint that ``resuming`` names. ``guard``: a tripped non-finite guard's step is never
    saved. ``job``: the Slurm job these ranks belong to, whose ownership of the run they check (None: a local run)."""

    def __init__(self, rd: RunDir, cfg: RunConfig, cfg_hash: str, flag: StopFlag, attempt: int,
                 guard: NonFiniteGuard | None = None, job: str | None = None) -> None:
        self.rd, self.cfg_hash, self.flag, self.attempt, self.guard = rd, cfg_hash, flag, attempt, guard
        self.every, self.keep = cfg["checkpoint"]["every_n_steps"], cfg["checkpoint"]["keep_last"]
        self.publish_timeout = float(cfg["network"]["pg_timeout_s"])  # other ranks' files: as long as a collective
        self.last_saved = -1
        self.stopped_by_signal = False
        self.t0 = time.time()
        self.owner = owner.Reader(rd, cfg["resume"]["owner_check_every_n_steps"], job)
        self.agreement = Agreement(flag, self.owner)
        self.writer = checkpoint.Writer()
        self.buffers: list[torch.Tensor] = []  # rank 0's copy of the last checkpoint, reused by the next (snapshot)
        self.group: Any = None  # sharded checkpoints: the background writes' own process group
        self.progress_at = 0.0
        self.outputs: Any = None  # what the last training step returned (rank 0): its loss goes to progress.json
        self.resume_from: Path | None = None
        self.rng: dict[str, Any] | None = None  # this rank's RNG state from the checkpoint, until restored
        self.moved: tuple[int, int, int] | None = None  # the data position moved onto another world size
        self.position = honesty.EPOCH_START  # how a resume continues the train loader mid-epoch (on_train_start)
        self.replayed = False  # this resume replayed the loader's pass to the checkpoint's batch
        # A checkpoint due at a batch after which Lightning validates or ends the epoch is written after them (by
        # ``write_deferred``, from runner's ``AfterEpochEnd`` or the next batch), and a stop waits for it.
        self.deferred = False
        self.deferred_stop = False
        # Here, not in on_train_start: a resume from a checkpoint at the last step (a time limit's, say)
        # reaches its end without Lightning starting to train, and the `finished` marker still needs them.
        self.t_start = time.time()
        self.base_productive = 0.0
        self.wd: watchdog.Watchdog | None = None  # told of each save's phases and of each write's duration

    def resuming(self, path: Path) -> None:
        """Before ``fit``: training continues from this checkpoint."""
        self.resume_from = path
        self.base_productive = checkpoint.manifest_of(path).get("productive_s", 0.0)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, ckpt: dict[str, Any]) -> None:
        """Before Lightning restores its loops: on another world size, a loader's global position (see
        ``internals.move_epoch_position``) is kept as such."""
        if self.resume_from is None:
            return
        self.moved = internals.move_epoch_position(ckpt, trainer.world_size)
        if self.moved:
            log.info("data position: %d batches of all ranks into the epoch, %d per rank on the checkpoint's "
                     "world size, %d per rank on this one", *self.moved)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rd = self.rd
        self.flag.take_over_sigterm()
        self.position = honesty.positioning(trainer.train_dataloader)[0]
        if internals.is_sharded(trainer.strategy):  # what this rank holds of the model, for tests and people
            mine, total = internals.resident_elements(pl_module)
            log.info("fsdp: this rank holds %d of the model's %d parameter elements", mine, total)
            atomic_write(rd.rank_params(trainer.global_rank),
                         json.dumps({"resident": mine, "model": total, "world_size": trainer.world_size}))
        self.last_saved = trainer.global_step
        self.t_start = time.time()
        resume_from = self.resume_from
        if trainer.global_rank == 0:
            before = read_json(rd.progress, {})  # {} when missing or damaged (said once)
            lost = max(int(number(before, "step", 0)) - trainer.global_step, 0)
            rd.record("train_start", step=trainer.global_step, lost_steps=lost, attempt=self.attempt,
                      resumed_from=str(resume_from) if resume_from else None)
            checkpoint.remove_staging(rd.checkpoints)  # a dead attempt's half-written files
        if resume_from is not None:
            rng_file = CheckpointDir.rng(resume_from, trainer.global_rank)
            if rng_file.is_file():
                self.rng = torch.load(rng_file, weights_only=False)
            else:
                log.warning("%s missing (world size changed?); RNG not restored", rng_file)
            # Between a checkpoint and the next step the uninterrupted run made no random draw mid-epoch, and
            # the next epoch's loader iterator at an epoch's end (a DataLoader draws its base seed then). The
            # resumed run makes that iterator's draw in any case: the state goes back after it mid-epoch, before
            # it at an epoch's end.
            saved = checkpoint.manifest_of(resume_from)
            if not saved.get("mid_epoch"):
                self.on_train_batch_start(trainer, pl_module, None, 0)
                internals.begin_epoch_pass(trainer)
                if internals.start_next_epoch_whole(trainer):
                    log.info("resumed at an epoch's end on %d batches an epoch per rank: the next epoch starts whole",
                             trainer.num_training_batches)
            elif self.position == honesty.REPLAYED and saved.get("world_size") == trainer.world_size:
                self.replay(trainer)
        if resume_from is not None or self.attempt > 1:
            adopt_last_checkpoints(trainer, self.rd)

    def replay(self, trainer: L.Trainer) -> None:
        """Resumed mid-epoch with a loader whose epoch is a function of the epoch: its pass is read up to the batch
        the checkpoint was taken after, so that each batch of the epoch is trained once."""
        batches = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        t0 = time.monotonic()
        taken = internals.skip_batches(trainer, batches)
        self.replayed = taken == batches
        # The RNG goes back to the checkpoint's now, not at the first batch: the uninterrupted run read the next
        # batch after the checkpoint (a dataset's augmentation draws as it reads), the resumed run reads it next too.
        self.on_train_batch_start(trainer, trainer.lightning_module, None, 0)
        log.info("data position: the epoch's pass replayed to batch %d (%d batches read, not trained, in %.1f s)%s",
                 batches, taken, time.monotonic() - t0, "" if self.replayed else ": the pass ended first")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.rng is not None:
            rng.restore(self.rng)
            self.rng = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        acc = trainer.accumulate_grad_batches
        boundary = (batch_idx + 1) % acc == 0 or batch_idx + 1 == trainer.num_training_batches
        if not boundary:
            return
        step = trainer.global_step
        verdict = self.agreement.check(trainer, step)
        if verdict == SUPERSEDED:
            self.owner.step_aside(step)
        stop = verdict == STOP
        if trainer.global_rank == 0:
            self.outputs = outputs  # a reference: read (one sync) only when progress is written
            if time.monotonic() - self.progress_at >= PROGRESS_S:
                self.progress(step)
            every_log = getattr(trainer, "log_every_n_steps", 50)  # a program's Trainer may say 0: no step lines
            if isinstance(every_log, int) and every_log > 0 and step % every_log == 0 and step != self.last_saved:
                loss = outputs["loss"].item() if isinstance(outputs, dict) else float("nan")
                log.info("step %d loss %.6f (%.1fs)", step, loss, time.time() - self.t0)
        if self.guard is not None and self.guard.tripped_at is not None:
            return  # a non-finite step: training stops here, and nothing of this step is saved
        stop = stop or self.deferred_stop
        # At each epoch's end too for a loader positioned mid-epoch only on its own layout, or not at all: a resume
        # that cannot continue its newest checkpoint mid-epoch (on another world size) goes back to this one.
        due = step != self.last_saved and (step % self.every == 0 or stop or self.deferred or (
            self.position in (honesty.EPOCH_START, honesty.REPLAYED) and internals.epoch_batches_done(trainer)[1]))
        if (due or stop) and trainer.strategy.reduce_boolean_decision(internals.epoch_end_follows(trainer),
                                                                      all=False):
            # Written after the validation or the epoch's end that follows this batch (Lightning's restart would
            # skip them): the program's own bookkeeping of a whole epoch runs, and is in the checkpoint.
            if stop and not self.deferred_stop:
                log.info("stop agreed at step %d: it waits for the epoch's end or the validation after this batch",
                         step)
            self.deferred, self.deferred_stop = due, stop
            return
        self.deferred = self.deferred_stop = False
        if due:
            self.save(trainer, step, batch_idx + 1)
        if stop:
            self.stopped_by_signal = True
            trainer.should_stop = True

    def write_deferred(self, trainer: L.Trainer) -> bool:
        """After a validation or an epoch's end: write the checkpoint that fell due at the batch before it (every
        rank at once). Returns whether it is a stop's."""
        if not (self.deferred or self.deferred_stop):
            return False
        stop, self.deferred, self.deferred_stop = self.deferred_stop, False, False
        step = trainer.global_step
        if step != self.last_saved:
            batches, ended = internals.epoch_batches_done(trainer)
            self.save(trainer, step, batches, mid_epoch=not ended)
        if stop:
            self.stopped_by_signal = True
            trainer.should_stop = True
        return stop

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write_deferred(trainer)  # training ended before the validation or epoch's end it waited for
        self.agreement.finish()
        self.writer.wait()  # the last checkpoint is complete before the launcher reports anything

    def save(self, trainer: L.Trainer, step: int, batches: int, mid_epoch: bool | None = None) -> None:
        """Checkpoint ``step``, taken after ``batches`` batches of this epoch (per rank); ``mid_epoch``: whether the
        epoch goes on after it (None: unless ``batches`` is the epoch's length)."""
        root, rank, world = self.rd.checkpoints, trainer.global_rank, trainer.world_size
        wd = self.wd
        if mid_epoch is None:
            mid_epoch = batches != trainer.num_training_batches
        if wd is not None:  # a wait as long as the previous write's rest: measured by the writes (below)
            wd.enter(watchdog.CHECKPOINT_WRITE)
        self.writer.wait()  # never two writes in flight
        if wd is not None:
            wd.enter(watchdog.CHECKPOINT)
        staging, published = CheckpointDir(root).staging(step), CheckpointDir(root).step(step)
        if rank == 0:
            self.progress(step)
        shards: dict[str, Any] | None = None
        meta: dict[str, Any] | None = None
        state = None
        if internals.is_sharded(trainer.strategy):  # FSDP2: every rank writes its own shard, nothing gathered
            if self.group is None:
                self.group = internals.checkpoint_group()  # every rank is here, at the same step
            shards, meta = internals.sharded_snapshot(trainer)
        elif not isinstance(trainer.strategy, DDPStrategy):  # FSDP1 & co. gather inside save_checkpoint
            staging.mkdir(parents=True, exist_ok=True)
            trainer.strategy.barrier("runner-ckpt-mkdir")
            trainer.save_checkpoint(CheckpointDir.model(staging))
        else:
            state = internals.snapshot(trainer, self.buffers)
        rng_state = rng.state()
        manifest: CheckpointManifest = {
            "step": step, "epoch": trainer.current_epoch, "config_hash": self.cfg_hash, "world_size": world,
            "time": time.time(), "runner_version": __version__, "productive_s": self.productive(),
            "mid_epoch": mid_epoch, "epoch_batches": batches, "accumulate": trainer.accumulate_grad_batches,
            "position": self.position}
        if shards is not None:
            manifest["format"] = checkpoint.SHARDED
        group, keep, publish_timeout = self.group, self.keep, self.publish_timeout

        def write() -> None:
            staging.mkdir(parents=True, exist_ok=True)
            if rank == 0 and state is not None:
                save(state, CheckpointDir.model(staging))
            if shards is not None:
                internals.dcp_save(shards, staging, group)  # returns once every rank's shard is written
                if rank == 0:
                    save(meta, CheckpointDir.meta(staging), sync_dir=False)
                checkpoint.write_digests(staging, rank)  # each rank hashes its own shard, in parallel
            # Rank 0 publishes (renames) the staging directory as soon as every file is there, and fsyncs
            # it first: the other ranks must not fsync a directory that may be gone by then.
            save(rng_state, CheckpointDir.rng(staging, rank), sync_dir=rank == 0)
            if rank != 0:
                return
            expected = [CheckpointDir.rng(staging, r) for r in range(world)]
            if shards is not None:
                expected += [CheckpointDir.digest(staging, r) for r in range(world)]
            missing = checkpoint.wait_for_files(expected, publish_timeout)
            if missing:
                log.warning("checkpoint %s not published: %s never written", published.name,
                            ", ".join(p.name for p in missing))
                return
            checkpoint.publish(root, step, manifest)
            checkpoint.prune(root, keep)
            log.info("checkpoint %s complete", published.name)

        def timed() -> None:
            t0 = time.monotonic()
            write()
            if wd is not None:
                wd.learn(watchdog.CHECKPOINT_WRITE, time.monotonic() - t0)

        self.writer.submit(timed)
        self.last_saved = step

    def productive(self) -> float:
        """Training seconds that a checkpoint keeps: earlier attempts' kept time plus this attempt's."""
        return round(self.base_productive + time.time() - self.t_start, 3)

    def progress(self, step: int) -> None:
        """The last step reached (rank 0), every few seconds and at every checkpoint: a restart compares it
        with its checkpoint to count the steps a failure cost (a crash between two records counts up to
        PROGRESS_S fewer), and a local run's terminal shows it with the loss. Advisory, so no fsync; a rename
        keeps it whole."""
        self.progress_at = time.monotonic()
        loss = _loss(self.outputs)
        atomic_write(self.rd.progress, json.dumps({"step": step, "time": time.time(), "attempt": self.attempt,
                                                   **({"loss": loss} if loss is not None else {})}) + "\n",
                     durable=False)
