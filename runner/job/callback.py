"""runner's in-process guarantees as one Lightning callback, for runner's own mode and for any Lightning program.

``Guarantees`` puts the parts together for one Trainer: the watchdog's pulse (hangs, stragglers), the non-finite
guard, the owner check, checkpoints at agreed steps (periodic and on a signal, per-rank RNG, ``COMPLETE`` last) and
the honesty record. ``Guarantees.fit`` runs a ``fit``: from runner's newest complete checkpoint, with the watchdog
armed, and turns how it ended into the launcher's exit code.

runner's own mode builds its Trainer with them (``runner.job.launch``). In program mode (``command:``) the user's
program builds its own Trainer, and Lightning adds the callbacks that the factories of the entry-point group
``lightning.pytorch.callbacks_factory`` return: ``runner.job.program_entry.factory`` is runner's, and returns the
callback only in a process that runner's launcher started for a run, nothing anywhere else. The resume door is
``Trainer.fit`` itself, wrapped once per process (``program_entry.wrap_fit``): runner's newest complete checkpoint
wins over the program's own ``ckpt_path`` (and over Lightning's ``hpc_ckpt``), which is used only while runner has
none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from runner import checkpoint
from runner.job import fallback, internals, jobenv, outcome, watchdog
from runner.job.ckpt_callback import RunnerCheckpoint, save
from runner.job.guards import NonFiniteGuard
from runner.job.honesty import Honesty
from runner.job.owner import OwnerCheck
from runner.job.resume import resume_point
from runner.job.stopflag import StopFlag
from runner.rundir import EXIT_NONFINITE, EXIT_REQUEUE, EXIT_TERMINATED, RunDir
from runner.spec.typed import RunConfig

log = logging.getLogger("runner.job.callback")


class Pulse(L.Callback):
    """The Lightning callback that feeds the watchdog from the training thread (timestamps only, no I/O): the steps,
    and the phases in which a long pause is no hang (``watchdog.MARKED``). Here, not in ``runner.job.watchdog``:
    the watchdog needs no Lightning (a plain program's ``runner.progress`` feeds it).

    Lightning calls runner's callback before the program's own hooks of the same name (and before its checkpoint
    callbacks), so a phase is marked before the program's slow part of it runs."""

    def __init__(self, wd: watchdog.Watchdog) -> None:
        self.wd = wd

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.batch_start()

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.before_backward()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.wd.beat(trainer.global_step)
        # The validation loader starts before on_validation_start. Asked only at a batch where Lightning may validate
        # or end the epoch: the question costs 9 us, a step's other hooks together ~25.
        every = trainer.val_check_batch
        if (every is None or (batch_idx + 1) % every == 0 or batch_idx + 1 >= trainer.num_training_batches) \
                and internals.epoch_end_follows(trainer):
            self.wd.enter(watchdog.BEFORE_VALIDATION)

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.enter(watchdog.VALIDATION)

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.enter(watchdog.VALIDATION)  # progress within the validation: its clock restarts

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.leave()

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.enter(watchdog.CHECKPOINT)  # the program's (ModelCheckpoint's) save, before its own hook runs

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.enter(watchdog.EPOCH_END)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.enter(watchdog.EPOCH_START)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.wd.stop()


class StopNow(L.Callback):
    """Once runner's checkpoint of a stop (a signal's agreed step) is written, training ends at once, the way
    Lightning's own SIGTERM handling ends it (``SIGTERMException`` after the batch): ``trainer.should_stop`` would
    still run the epoch's end, a validation and the program's own checkpoint callbacks. Last of runner's parts, so
    each of them has seen the step; ``Guarantees.fit`` turns the exception into the requeue exit."""

    def __init__(self, ckpt: RunnerCheckpoint) -> None:
        self.ckpt = ckpt

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.ckpt.stopped_by_signal:
            self.ckpt.on_train_end(trainer, pl_module)  # the agreement's reduction done, the checkpoint complete
            raise SIGTERMException


class AfterEpochEnd(Checkpoint):
    """Writes runner's checkpoint that fell due at a batch after which Lightning validates or ends the epoch once
    they are done (``RunnerCheckpoint.write_deferred``), and ends training there when it is a stop's, as ``StopNow``
    does after a batch. A ``Checkpoint``, so that Lightning calls its ``on_train_epoch_end`` with the checkpoint
    callbacks, after the program's own: their saves of the epoch are in runner's checkpoint, which a resume then
    continues after the epoch's end (Lightning's restart from a checkpoint taken before it skips it: no validation, no
    epoch-end callback, no ModelCheckpoint of that epoch). ``Guarantees.fit`` puts it last of the Trainer's callbacks
    and takes it out after ``fit``."""

    def __init__(self, ckpt: RunnerCheckpoint) -> None:
        self.ckpt = ckpt

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (self.ckpt.deferred or self.ckpt.deferred_stop) and not trainer.sanity_checking \
                and not internals.epoch_batches_done(trainer)[1]:  # a validation mid-epoch; else the epoch's end
            self.write(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, pl_module)

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.ckpt.write_deferred(trainer):
            self.ckpt.on_train_end(trainer, pl_module)  # the agreement's reduction done, the checkpoint complete
            raise SIGTERMException


class RunnerCallbacks(L.Callback):
    """runner's parts as one Lightning callback (``combine`` adds their hooks); ``runner``: whose parts they are."""

    runner: Guarantees | None = None


def combine(parts: list[L.Callback]) -> RunnerCallbacks:
    """One Lightning callback that calls each hook of ``parts``, in their order, only on the parts that define it.

    Lightning calls every hook of every callback at every step, ~3 us a call even when the hook does nothing:
    runner's five callbacks cost ~0.1 ms of a 5 ms step that way (measured), one callback a fifth of that.
    """
    def forward(impls: list[Callable[..., None]]) -> Callable[..., None]:
        def hook(self: RunnerCallbacks, *args: Any, **kwargs: Any) -> None:
            for impl in impls:
                impl(*args, **kwargs)
        return hook

    hooks: dict[str, Callable[..., None]] = {}
    for name, base in vars(L.Callback).items():
        impls = [getattr(p, name) for p in parts if callable(base) and getattr(type(p), name) is not base]
        if not impls or name.startswith("_"):
            continue
        if name in ("state_dict", "load_state_dict"):  # their results would need merging; no part has state
            raise TypeError(f"{name} of {impls} cannot be combined")
        hooks[name] = forward(impls)
    combined: RunnerCallbacks = type("RunnerCallbacks", (RunnerCallbacks,), hooks)()
    return combined


class Guarantees:
    """runner's parts for one Trainer of one rank, and how a ``fit`` with them ends."""

    def __init__(self, rd: RunDir, cfg: RunConfig, cfg_hash: str, flag: StopFlag, rank: int, world: int,
                 attempt: int, configured_batch: int | None, extra: list[L.Callback] | None = None) -> None:
        self.rd, self.cfg, self.cfg_hash, self.rank, self.world, self.attempt = rd, cfg, cfg_hash, rank, world, attempt
        self.guard = NonFiniteGuard(rd, cfg["nonfinite"]["action"], cfg["nonfinite"]["max_skips"])
        job = jobenv.current().job_id
        self.checkpoint = RunnerCheckpoint(rd, cfg, cfg_hash, flag, attempt, self.guard, job)
        w = cfg["watchdog"]
        self.watchdog = watchdog.Watchdog(rd, rank, world, attempt, factor=w["factor"], floor_s=w["floor_s"],
                                          report_every_s=w["straggler_report_s"], first_step_s=w["first_step_s"],
                                          phase_s=w["phase_s"]) if w["enabled"] else None
        self.checkpoint.wd = self.watchdog  # runner's own save: its wait for the previous write, its snapshot
        pulse = [Pulse(self.watchdog)] if self.watchdog else []
        self.honesty = Honesty(rd, configured_batch, rank, world, cfg["checkpoint"]["exact_resume"],
                               moved=lambda: self.checkpoint.moved, replayed=lambda: self.checkpoint.replayed)
        self.after_epoch_end = AfterEpochEnd(self.checkpoint)
        # The non-finite guard runs before the optimizer step and before the checkpoint callback; the watchdog's
        # pulse first of all, so the stall clock stops before the last checkpoint is awaited at the end.
        self.parts: list[L.Callback] = [*(extra or []), *pulse, self.guard, OwnerCheck(rd, job), self.checkpoint,
                                        self.honesty, StopNow(self.checkpoint)]
        self.callback = combine(self.parts)
        self.callback.runner = self  # how the wrapped Trainer.fit finds its trainer's guarantees

    def fit(self, trainer: L.Trainer, call: Callable[[str | None], None], asked: str | None = None,
            tried: int = 0) -> int | None:
        """Run ``call(ckpt_path)`` (``trainer``'s ``fit``) from runner's newest complete checkpoint, or from ``asked``
        (the program's own) while runner has none. Returns the launcher's exit code when training stopped before
        its end (a signal, a non-finite step, SIGTERM), None when ``fit`` ended by itself. A checkpoint that failed
        to load on the ranks is skipped for the previous one (``runner.job.fallback``; ``tried``: those before)."""
        def step() -> int:
            return int(trainer.global_step)

        last = resume_point(self.rd, self.cfg, self.cfg_hash, self.rank, self.attempt, tried) \
            if self.cfg["resume"]["enabled"] else None
        ckpt = asked
        if last:
            # A sharded checkpoint is the directory itself: Lightning's ModelParallelStrategy loads a DCP directory
            # (``meta.pt`` beside the shards) into this world size, resharding when it differs from the writer's.
            ckpt = str(last[1]) if checkpoint.is_sharded(last[1]) else str(checkpoint.CheckpointDir.model(last[1]))
            newest = checkpoint.latest(self.rd.checkpoints, self.cfg_hash, self.cfg["resume"]["force"])
            passed_over = newest[0] if newest and newest[0] > last[0] and \
                checkpoint.passed_over(newest[1], self.world) else None
            self.checkpoint.resuming(last[1])
            self.honesty.resuming(last[1], passed_over)
            log.info("resuming from %s (step %d)%s%s", last[1], last[0],
                     f" instead of the program's ckpt_path {asked}" if asked else "",
                     f", the epoch's start: the loader cannot be positioned at step {passed_over}, mid-epoch, on "
                     f"{self.world} ranks"
                     if passed_over is not None else "")
        elif self.cfg["resume"]["enabled"] and (newest := checkpoint.latest(self.rd.checkpoints, self.cfg_hash)) \
                and checkpoint.passed_over(newest[1], self.world):
            log.info("starting from the beginning: the newest checkpoint (step %d) is mid-epoch, where the loader "
                     "cannot be positioned, and none is at an epoch's end", newest[0])
        if self.watchdog:
            self.watchdog.start()  # imports, preflight and the program's own start are not hangs
        flag = self.checkpoint.flag
        flag.driving = True  # a signal now waits for an agreed step (stopflag: a program's meaning outside a fit)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # public, set by its connector, not declared
        callbacks.append(self.after_epoch_end)  # last of all: after the program's checkpoint callbacks
        watch, why = fallback.LoadWatch(trainer) if last else None, None
        try:
            call(ckpt)
        except SIGTERMException:
            if self.checkpoint.stopped_by_signal:  # runner's stop checkpoint is written (StopNow or AfterEpochEnd)
                log.info("stopped on signal at step %d; exit %d (requeue)", step(), EXIT_REQUEUE)
                return EXIT_REQUEUE
            log.warning("terminated (SIGTERM) before the end of training")
            return EXIT_TERMINATED
        except BaseException as e:  # the traceback still reaches the log; the record lets the exit hook spot a loop
            if last is None or watch is None or (why := watch.failed(e)) is None:
                if isinstance(e, Exception):
                    outcome.record_crash(self.rd, self.attempt, self.rank, step(), e)
                raise
            fallback.skip(self.rd, self.rank, last[0], last[1], why)
        finally:
            flag.driving = False
            if self.after_epoch_end in callbacks:
                callbacks.remove(self.after_epoch_end)  # the program's own Trainer again, for its code after fit
            if self.watchdog:
                self.watchdog.stop()
        if why is not None:  # every rank: the checkpoint verified yet failed to load; the previous one, never it again
            return self.fit(trainer, call, asked, tried + 1)
        if self.guard.tripped_at is not None:
            log.error("stopped at step %d on a non-finite loss or gradient; exit %d", self.guard.tripped_at,
                      EXIT_NONFINITE)
            return EXIT_NONFINITE
        if self.checkpoint.stopped_by_signal:
            log.info("stopped on signal at step %d; exit %d (requeue)", step(), EXIT_REQUEUE)
            return EXIT_REQUEUE
        return None

    def save_final(self, trainer: L.Trainer) -> None:
        """Each rank's weights after training (``final/rank-XXXXX.pt``): what a resumed run is compared by."""
        state = trainer.lightning_module.state_dict()  # with fsdp: this rank's shards (never gathered)
        save({k: internals.local(v).detach().cpu() for k, v in state.items()}, self.rd.final_weights(self.rank))
