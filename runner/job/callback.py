"""runner's in-process guarantees as one Lightning callback, for runner's own mode and for any Lightning program.

``Guarantees`` puts the parts together for one Trainer: the watchdog's pulse (hangs, stragglers), the non-finite
guard, the owner check, checkpoints at agreed steps (periodic and on a signal, per-rank RNG, ``COMPLETE`` last) and
the honesty record. ``Guarantees.fit`` runs a ``fit``: from runner's newest complete checkpoint, with the watchdog
armed, and turns how it ended into the launcher's exit code.

runner's own mode builds its Trainer with them (``runner.job.launch``). In program mode (``command:``) the user's
program builds its own Trainer, and Lightning adds the callbacks that the factories of the entry-point group
``lightning.pytorch.callbacks_factory`` return (``_load_external_callbacks``): ``factory`` is runner's, and returns
the callback only in a process that runner's launcher started for a run (``PROGRAM_ENV``), nothing anywhere else.
The resume door is ``Trainer.fit`` itself, wrapped once per process (``_wrap_fit``): runner's newest complete
checkpoint wins over the program's own ``ckpt_path`` (and over Lightning's ``hpc_ckpt``), which is used only while
runner has none.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from runner import __version__, checkpoint
from runner.job import guards, honesty, internals, owner, watchdog
from runner.log import setup as setup_logging
from runner.rundir import (
    ATTEMPT_ENV,
    EXIT_NONFINITE,
    EXIT_PROGRAM,
    EXIT_REQUEUE,
    EXIT_TERMINATED,
    RunDir,
    atomic_write,
    number,
    read_json,
)
from runner.spec.typed import RunConfig, read_resolved

log = logging.getLogger("runner.job.callback")

PROGRAM_ENV = "RUNNER_PROGRAM_RUN_DIR"  # set by the launcher for a program (command:): the run directory
AGREE_S = 0.1  # aim: ranks compare stop flags about this often (or every step, when slower)
PROGRESS_S = 2.0  # progress.json is rewritten at most this often (and at every checkpoint)
STOP, SUPERSEDED = "stop", "superseded"  # what the ranks agree on (Agreement.check)


class StopFlag:
    """Set by a signal handler; read at the next step boundary (never checkpoint inside a handler)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.installed: set[int] = set()

    def install(self, signame: str) -> None:
        sig = getattr(signal, f"SIG{signame}")
        if sig in self.installed:
            return
        self.installed.add(sig)
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any) -> None:
            self.set(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)

    def set(self, signum: int, frame: Any = None) -> None:
        self.signum = signum
        log.info("received %s; checkpointing at the next agreed step", signal.Signals(signum).name)

    def take_over_sigterm(self) -> None:
        """Replace Lightning's SIGTERM handler (it broadcasts inside the handler and stops each rank on its own
        flag): SIGTERM then stops the ranks at an agreed step, with a checkpoint, like the requeue signal.
        Lightning's teardown puts back the handler that was there before ``fit``."""
        signal.signal(signal.SIGTERM, self.set)


_FLAG: list[StopFlag] = []


def stop_flag(signame: str = "USR2") -> StopFlag:
    """This process's one stop flag, its handlers installed on first use: the launcher installs them before
    anything else (a signal may come seconds after the job starts), and a program's callback finds the same flag."""
    if not _FLAG:
        _FLAG.append(StopFlag())
    flag = _FLAG[0]
    flag.install(signame)
    if signame != "TERM":
        flag.install("TERM")  # scancel / preemption: checkpoint at the next step if the grace time allows
    return flag


def _verdict(stop: bool, superseded: bool) -> str | None:
    return SUPERSEDED if superseded else STOP if stop else None  # a superseded job writes nothing, not even on a signal


class Agreement:
    """Decides, identically on every rank, at which step training stops, without a blocking collective per step.

    At a check step every rank waits for the reduction it started at the previous check (long done by now), reads
    the verdict, and starts the next one, non-blocking: ``[stop flag, superseded, steps until the next check]``,
    reduced with MAX (rank 0 proposes the interval from its step time, so every rank agrees on the next check
    step). A signal is acted on within two intervals (0.2 s, or two steps); the stop step is the same on every
    rank, and the checkpoint is written there, so a preemption loses no step. ``superseded(step)`` is this rank's
    reading of the run's owner (``owner.Reader``): when any rank finds another job owns the run, every rank
    leaves at the same step, without a checkpoint.
    """

    def __init__(self, flag: StopFlag, superseded: Callable[[int], bool] = lambda step: False) -> None:
        self.flag = flag
        self.superseded = superseded
        self.next_check = -1
        self.every = 1
        self.work: Any = None
        self.buf: Any = None
        self.mark: tuple[float, int] | None = None

    def check(self, trainer: Any, step: int) -> str | None:
        """Called at every optimizer step boundary with the global step: STOP or SUPERSEDED when all ranks stop
        here (for that reason), else None."""
        import torch
        import torch.distributed as dist

        if step < self.next_check:  # most steps: nothing more to do
            return None
        if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
            return _verdict(self.flag.signum is not None, self.superseded(step))  # next_check stays -1
        verdict = None
        if self.work is not None:
            self.work.wait()
            verdict = _verdict(bool(self.buf[0].item()), bool(self.buf[1].item()))
            self.every = max(int(self.buf[2].item()), 1)
            self.work = None
        self.next_check = step + self.every
        if verdict:
            return verdict
        mine = [int(self.flag.signum is not None), int(self.superseded(step))]
        self.buf = torch.tensor([*mine, self.propose(step) if trainer.global_rank == 0 else 0], dtype=torch.int64,
                                device=trainer.strategy.root_device)
        self.work = dist.all_reduce(self.buf, op=dist.ReduceOp.MAX, async_op=True)
        return None

    def propose(self, step: int) -> int:
        now = time.monotonic()
        every = self.every
        if self.mark is not None and step > self.mark[1]:
            step_s = (now - self.mark[0]) / (step - self.mark[1])
            every = int(min(max(AGREE_S / max(step_s, 1e-6), 1), 100))
        self.mark = (now, step)
        return every

    def finish(self) -> None:
        """At the end of training (every rank): complete the reduction still in flight."""
        if self.work is not None:
            self.work.wait()
            self.work = None


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(obj: Any, path: Path, sync_dir: bool = True) -> None:
    """torch.save straight into the file: serializing into memory first held the GIL twice as long (measured: a
    400 MB checkpoint took 0.57 s instead of 0.30 s, and the training thread got 70% of its time instead of 92%)."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f), sync_dir=sync_dir)


def _loss(outputs: Any) -> float | None:
    """The training step's loss as a number (what ``training_step`` returned), None where it returned none."""
    loss: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        value = float(loss.item() if hasattr(loss, "item") else loss)
    except (TypeError, ValueError, RuntimeError):
        return None
    return value if math.isfinite(value) else None


def make_checkpoint(rd: RunDir, cfg: RunConfig, cfg_hash: str, flag: StopFlag, attempt: int, guard: Any = None) \
        -> Any:
    """The Lightning callback that owns checkpoints: periodic, on signal, RNG per rank, COMPLETE last.

    A checkpoint costs the training thread one copy of the state; serializing, writing, fsyncing and hashing
    happen in a background thread (``checkpoint.Writer``), one checkpoint at a time.
    """
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    every, keep = cfg["checkpoint"]["every_n_steps"], cfg["checkpoint"]["keep_last"]
    publish_timeout = float(cfg["network"]["pg_timeout_s"])  # other ranks' files, at most as long as a collective

    class RunnerCheckpoint(L.Callback):
        def __init__(self) -> None:
            self.last_saved = -1
            self.stopped_by_signal = False
            self.t0 = time.time()
            self.owner = owner.Reader(rd, cfg["resume"]["owner_check_every_n_steps"])
            self.agreement = Agreement(flag, self.owner)
            self.writer = checkpoint.Writer()
            self.buffers: list[Any] = []  # rank 0's copy of the last checkpoint, reused by the next (snapshot)
            self.group: Any = None  # sharded checkpoints: the background writes' own process group
            self.progress_at = 0.0
            self.outputs: Any = None  # what the last training step returned (rank 0): its loss goes to progress.json
            self.resume_from: Path | None = None
            self.rng: dict[str, Any] | None = None  # this rank's RNG state from the checkpoint, until restored
            self.moved: tuple[int, int, int] | None = None  # the data position moved onto another world size
            # Here, not in on_train_start: a resume from a checkpoint at the last step (a time limit's, say)
            # reaches its end without Lightning starting to train, and the `finished` marker still needs them.
            self.t_start = time.time()
            self.base_productive = 0.0

        def resuming(self, path: Path) -> None:
            """Before ``fit``: training continues from this checkpoint."""
            self.resume_from = path
            self.base_productive = float(number(checkpoint.manifest_of(path), "productive_s", 0.0))

        def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                               ckpt: dict[str, Any]) -> None:
            """Before Lightning restores its loops: on another world size, a loader's global position (see
            ``internals.move_epoch_position``) is kept as such."""
            if self.resume_from is None:
                return
            self.moved = internals.move_epoch_position(ckpt, trainer.world_size)
            if self.moved:
                log.info("data position: %d batches of all ranks into the epoch, %d per rank on the checkpoint's "
                         "world size, %d per rank on this one", *self.moved)

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            flag.take_over_sigterm()
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
                rd.record("train_start", step=trainer.global_step, lost_steps=lost, attempt=attempt,
                          resumed_from=str(resume_from) if resume_from else None)
                checkpoint.remove_staging(rd.checkpoints)  # a dead attempt's half-written files
            if resume_from is not None:
                rng = resume_from / f"rng-rank{trainer.global_rank:05d}.pt"
                if rng.is_file():
                    self.rng = torch.load(rng, weights_only=False)
                else:
                    log.warning("%s missing (world size changed?); RNG not restored", rng)
                # Between a checkpoint and the next step the uninterrupted run made no random draw mid-epoch, and
                # the next epoch's loader iterator at an epoch's end (a DataLoader draws its base seed then). The
                # resumed run makes that iterator's draw in any case: the state goes back after it mid-epoch, before
                # it at an epoch's end.
                if not checkpoint.manifest_of(resume_from).get("mid_epoch"):
                    self.on_train_batch_start(trainer, pl_module, None, 0)

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if self.rng is not None:
                _set_rng_state(self.rng)
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
            if guard is not None and guard.tripped_at is not None:
                return  # a non-finite step: training stops here, and nothing of this step is saved
            if step != self.last_saved and (step % every == 0 or stop):
                self.save(trainer, step, batch_idx + 1)
            if stop:
                self.stopped_by_signal = True
                trainer.should_stop = True

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.agreement.finish()
            self.writer.wait()  # the last checkpoint is complete before the launcher reports anything

        def save(self, trainer: L.Trainer, step: int, batches: int) -> None:
            """Checkpoint ``step``, taken after ``batches`` batches of this epoch (per rank)."""
            root, rank, world = rd.checkpoints, trainer.global_rank, trainer.world_size
            mid_epoch = batches != trainer.num_training_batches
            self.writer.wait()  # never two writes in flight
            staging = checkpoint.staging_dir(root, step)
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
                trainer.save_checkpoint(staging / checkpoint.MODEL)
            else:
                state = internals.snapshot(trainer, self.buffers)
            rng = _rng_state()
            manifest = {"step": step, "epoch": trainer.current_epoch, "config_hash": cfg_hash, "world_size": world,
                        "time": time.time(), "runner_version": __version__, "productive_s": self.productive(),
                        "mid_epoch": mid_epoch, "epoch_batches": batches,
                        "accumulate": trainer.accumulate_grad_batches}
            if shards is not None:
                manifest["format"] = checkpoint.SHARDED
            group = self.group

            def write() -> None:
                staging.mkdir(parents=True, exist_ok=True)
                if rank == 0 and state is not None:
                    save(state, staging / checkpoint.MODEL)
                if shards is not None:
                    internals.dcp_save(shards, staging, group)  # returns once every rank's shard is written
                    if rank == 0:
                        save(meta, staging / internals.META, sync_dir=False)
                    checkpoint.write_digests(staging, rank)  # each rank hashes its own shard, in parallel
                # Rank 0 publishes (renames) the staging directory as soon as every file is there, and fsyncs
                # it first: the other ranks must not fsync a directory that may be gone by then.
                save(rng, staging / f"rng-rank{rank:05d}.pt", sync_dir=rank == 0)
                if rank != 0:
                    return
                expected = [staging / f"rng-rank{r:05d}.pt" for r in range(world)]
                if shards is not None:
                    expected += [checkpoint.digest_file(staging, r) for r in range(world)]
                missing = checkpoint.wait_for_files(expected, publish_timeout)
                if missing:
                    log.warning("checkpoint step-%07d not published: %s never written", step,
                                ", ".join(p.name for p in missing))
                    return
                checkpoint.publish(root, step, manifest)
                checkpoint.prune(root, keep)
                log.info("checkpoint step-%07d complete", step)

            self.writer.submit(write)
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
            atomic_write(rd.progress, json.dumps({"step": step, "time": time.time(), "attempt": attempt,
                                                  **({"loss": loss} if loss is not None else {})}) + "\n",
                         durable=False)

    return RunnerCheckpoint()


def combine(parts: list[Any]) -> Any:
    """One Lightning callback that calls each hook of ``parts``, in their order, only on the parts that define it.

    Lightning calls every hook of every callback at every step, ~3 us a call even when the hook does nothing:
    runner's five callbacks cost ~0.1 ms of a 5 ms step that way (measured), one callback a fifth of that.
    """
    import lightning as L

    def forward(impls: list[Any]) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> None:
            for impl in impls:
                impl(*args, **kwargs)
        return hook

    hooks: dict[str, Any] = {}
    for name, base in vars(L.Callback).items():
        impls = [getattr(p, name) for p in parts if callable(base) and getattr(type(p), name) is not base]
        if not impls or name.startswith("_"):
            continue
        if name in ("state_dict", "load_state_dict"):  # their results would need merging; no part has state
            raise TypeError(f"{name} of {impls} cannot be combined")
        hooks[name] = forward(impls)
    return type("RunnerCallbacks", (L.Callback,), hooks)()


def ranks() -> tuple[int, int, int, int]:
    """(global rank, local rank, node rank, world size) from srun's or the local launcher's variables."""
    env = os.environ
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return (int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NODEID", 0)),
                int(env["SLURM_NTASKS"]))
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", 0)), \
        int(env.get("WORLD_SIZE", 1))


def current_attempt(rd: RunDir) -> int:
    """The attempt whose ranks these are, as claimed by whoever started them (``RUNNER_ATTEMPT``).

    A rank never claims one itself: every rank would claim its own. Started by hand without the variable, a
    rank joins the latest attempt (or the first).
    """
    value = os.environ.get(ATTEMPT_ENV, "")
    return int(value) if value.isdigit() else (rd.attempts() or [1])[-1]


def resume_point(rd: RunDir, cfg: RunConfig, cfg_hash: str, rank: int, attempt: int) -> tuple[int, Path] | None:
    """The newest complete, verified checkpoint: rank 0 hashes the files, the other ranks wait for its verdict.

    One reader instead of one per rank (a shared file system would serve the whole checkpoint world-size
    times). The verdict names its attempt and job, so a verdict left by an earlier attempt is never taken.
    """
    verdict = rd.logs / ".resume-verdict.json"
    me = {"attempt": attempt, "job": os.environ.get("SLURM_JOB_ID"),
          "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}
    if rank == 0:
        last = checkpoint.latest(rd.checkpoints, cfg_hash, cfg["resume"]["force"], check=True)
        atomic_write(verdict, json.dumps({**me, "step": last[0] if last else None,
                                          "path": str(last[1]) if last else None}))
        return last
    deadline = time.monotonic() + cfg["network"]["pg_timeout_s"]
    while time.monotonic() < deadline:
        got = read_json(verdict, {}) or {}
        if all(got.get(k) == v for k, v in me.items()):
            return (int(got["step"]), Path(got["path"])) if got.get("path") else None
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 gave no checkpoint verdict in {verdict} within {cfg['network']['pg_timeout_s']} s")


class Guarantees:
    """runner's parts for one Trainer of one rank, and how a ``fit`` with them ends."""

    def __init__(self, rd: RunDir, cfg: RunConfig, cfg_hash: str, flag: StopFlag, rank: int, world: int,
                 attempt: int, configured_batch: int | None, extra: list[Any] | None = None) -> None:
        self.rd, self.cfg, self.cfg_hash, self.rank, self.world, self.attempt = rd, cfg, cfg_hash, rank, world, attempt
        self.guard = guards.make_guard(rd, cfg["nonfinite"]["action"], cfg["nonfinite"]["max_skips"])
        self.checkpoint = make_checkpoint(rd, cfg, cfg_hash, flag, attempt, self.guard)
        w = cfg["watchdog"]
        self.watchdog = watchdog.Watchdog(rd, rank, world, attempt, factor=w["factor"], floor_s=w["floor_s"],
                                          report_every_s=w["straggler_report_s"],
                                          first_step_s=w["first_step_s"]) if w["enabled"] else None
        pulse = [watchdog.make_pulse(self.watchdog)] if self.watchdog else []
        self.honesty = honesty.callback(rd, configured_batch, rank, world, cfg["checkpoint"]["exact_resume"],
                                        moved=lambda: self.checkpoint.moved)
        # The non-finite guard runs before the optimizer step and before the checkpoint callback; the watchdog's
        # pulse first of all, so the stall clock stops before the last checkpoint is awaited at the end.
        self.parts = [*(extra or []), *pulse, self.guard, owner.make_callback(rd), self.checkpoint,
                      self.honesty]
        self.callback = combine(self.parts)
        self.callback.runner = self  # how the wrapped Trainer.fit finds its trainer's guarantees

    def fit(self, trainer: Any, call: Callable[[str | None], None], asked: str | None = None) -> int | None:
        """Run ``call(ckpt_path)`` (``trainer``'s ``fit``) from runner's newest complete checkpoint, or from ``asked``
        (the program's own) while runner has none. Returns the launcher's exit code when training stopped before
        its end (a signal, a non-finite step, SIGTERM), None when ``fit`` ended by itself."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        def step() -> int:
            return int(trainer.global_step)

        last = resume_point(self.rd, self.cfg, self.cfg_hash, self.rank, self.attempt) \
            if self.cfg["resume"]["enabled"] else None
        ckpt = asked
        if last:
            # A sharded checkpoint is the directory itself: Lightning's ModelParallelStrategy loads a DCP directory
            # (``meta.pt`` beside the shards) into this world size, resharding when it differs from the writer's.
            ckpt = str(last[1]) if checkpoint.is_sharded(last[1]) else str(last[1] / checkpoint.MODEL)
            self.checkpoint.resuming(last[1])
            self.honesty.resuming(last[1])
            log.info("resuming from %s (step %d)%s", last[1], last[0],
                     f" instead of the program's ckpt_path {asked}" if asked else "")
        if self.watchdog:
            self.watchdog.start()  # imports, preflight and the program's own start are not hangs
        try:
            call(ckpt)
        except SIGTERMException:
            if self.checkpoint.stopped_by_signal:  # our callback checkpointed before Lightning's SIGTERM exit
                log.info("checkpointed on SIGTERM; exit %d", EXIT_REQUEUE)
                return EXIT_REQUEUE
            log.warning("terminated (SIGTERM) before the end of training")
            return EXIT_TERMINATED
        except Exception as e:  # the traceback still reaches the log; the record lets the exit hook spot a loop
            guards.record_crash(self.rd, self.attempt, self.rank, step(), e)
            raise
        finally:
            if self.watchdog:
                self.watchdog.stop()
        if self.guard.tripped_at is not None:
            log.error("stopped at step %d on a non-finite loss or gradient; exit %d", self.guard.tripped_at,
                      EXIT_NONFINITE)
            return EXIT_NONFINITE
        if self.checkpoint.stopped_by_signal:
            log.info("stopped on signal at step %d; exit %d (requeue)", step(), EXIT_REQUEUE)
            return EXIT_REQUEUE
        return None

    def save_final(self, trainer: Any) -> None:
        """Each rank's weights after training (``final/rank-XXXXX.pt``): what a resumed run is compared by."""
        state = trainer.lightning_module.state_dict()  # with fsdp: this rank's shards (never gathered)
        save({k: internals.local(v).detach().cpu() for k, v in state.items()},
             self.rd.final / f"rank-{self.rank:05d}.pt")



def finished(rd: RunDir, step: int | None, productive_s: float | None = None, **fields: Any) -> None:
    """Rank 0, once training ended: the ``finished`` marker and its ledger line."""
    atomic_write(rd.finished, json.dumps({"step": step, "time": time.time(), "productive_s": productive_s}) + "\n")
    rd.record("finished", step=step, **fields)


# ---------------------------------------------------------------------------------------------------------------
# Program mode: the callback in the user's own Trainer


def outcome_file(rd: RunDir, attempt: int, rank: int) -> Path:
    """What a program's fit did on this rank (written by the wrapped ``Trainer.fit``, read by the launcher)."""
    return rd.attempt_logs(attempt) / f"program-rank-{rank:05d}.json"


def factory() -> list[Any]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: runner's callback for a Trainer built by a program
    that runner's launcher runs (``PROGRAM_ENV`` names the run), nothing in any other process."""
    run_dir = os.environ.get(PROGRAM_ENV)
    if not run_dir:
        return []
    rd = RunDir(Path(run_dir))
    cfg = read_resolved(rd.config)
    flag = stop_flag(cfg["slurm"]["signal"])
    if not logging.getLogger("runner").handlers:  # a program's own process: runner's lines stamped, as the launcher's
        setup_logging(stamped=True)
    rank, _, _, world = ranks()
    manifest = read_json(rd.manifest, {}) or {}
    g = Guarantees(rd, cfg, str(manifest.get("config_hash", "")), flag, rank, world, current_attempt(rd), None,
                   extra=[_program_setup(cfg)])
    _wrap_fit()
    return [g.callback]


def _program_setup(cfg: RunConfig) -> Any:
    """The part only a program's Trainer needs, at its ``setup`` (before the strategy wraps the model): plain DDP
    gets the one bucket layout of exact resume."""
    import lightning as L

    class ProgramSetup(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            if stage == "fit" and cfg["checkpoint"]["exact_resume"]:
                done = internals.fix_bucket_layout(trainer.strategy)
                if done:
                    log.info("exact resume: the program's DDP gets %s", done)

    return ProgramSetup()


def _check_world(trainer: Any, g: Guarantees) -> None:
    """Before the program's ``fit`` sets up its devices: it trains the world size runner started, else exit
    EXIT_PROGRAM on every rank with one line (and rank 0's ledger entry). Checked any later, a rank whose local rank
    is not among the Trainer's devices has already died of an IndexError in Lightning's setup."""
    trains = trainer.num_nodes * trainer.num_devices
    if trains == g.world:
        return
    cfg = g.cfg
    why = (f"the program's Trainer trains {trains} ranks (num_nodes={trainer.num_nodes} x "
           f"devices={trainer.num_devices}); runner started {g.world} (num_nodes={cfg['num_nodes']} x "
           f"num_device={cfg['num_device']})")
    log.error("program: %s. hint: pass devices=%d and num_nodes=%d to the program's Trainer", why,
              cfg["num_device"], cfg["num_nodes"])
    if g.rank == 0:
        g.rd.record("program_error", reason="world_size", detail=why)
    raise SystemExit(EXIT_PROGRAM)


def _wrap_fit() -> None:
    """Wrap ``Trainer.fit`` (public, and stable across Lightning 2.x) once per process: a Trainer that carries
    runner's callback fits through ``Guarantees.fit``; any other Trainer fits as before."""
    import lightning as L

    original = L.Trainer.fit
    if getattr(original, "runner_wrapped", False):
        return
    signature = inspect.signature(original)
    fits: list[int] = []

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> None:
        g = next((cb.runner for cb in self.callbacks if isinstance(getattr(cb, "runner", None), Guarantees)), None)
        if g is None:
            return original(self, *args, **kwargs)
        _check_world(self, g)
        fits.append(1)
        if len(fits) > 1:  # runner's checkpoints resume one fit; a second one is the program's own business
            log.warning("this program calls fit a second time: runner does not resume it from its checkpoints")
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)

        def call(ckpt: str | None) -> None:
            bound.arguments["ckpt_path"] = ckpt
            original(*bound.args, **bound.kwargs)

        code = g.fit(self, call, bound.arguments.get("ckpt_path"))
        step = int(self.global_step)
        atomic_write(outcome_file(g.rd, g.attempt, g.rank), json.dumps(
            {"step": step, "code": code, "resumed": g.checkpoint.resume_from is not None, "time": time.time(),
             "productive_s": g.checkpoint.productive()}))
        if code is not None:
            raise SystemExit(code)  # the program's code after fit runs in the attempt that finishes training
        g.save_final(self)
        with contextlib.suppress(Exception):
            self.strategy.barrier("runner-final")

    fit.runner_wrapped = True  # type: ignore[attr-defined]
    L.Trainer.fit = fit  # type: ignore[method-assign]


def configured_batch(cfg: RunConfig, world: int) -> int | None:
    """The global batch the config asks for (runner's own mode), None in program mode (the program's own)."""
    batch = cast(dict[str, Any], cfg["dataloader"]["train"]).get("batch_size")
    return None if cfg.get("command") or batch is None else \
        int(batch) * world * cfg["trainer"]["accumulate_grad_batches"]
