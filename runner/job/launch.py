"""The launcher: ``python -m runner.job.launch RUN_DIR`` runs one rank of the training.

It runs inside the allocation, in the container: one process per device, started by srun (or by
``runner submit`` on this machine for a local run). It reads the run's resolved config, sets up the rank (signals,
its log, the network environment, the preflight), then either trains runner's own model and data (seeded per rank,
from the newest complete checkpoint, with ``runner.job.callback``'s guarantees) or runs the config's program
(``command:``, ``runner.job.program``), whose own Trainer gets the same callback. Exit codes tell the batch script
what happened, because Lightning itself exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import inspect
import io
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from runner import __version__, redaction
from runner.errors import RunnerError
from runner.job import container, jobenv, outcome
from runner.job.resume import current_attempt
from runner.job.stopflag import stop_flag
from runner.log import setup as setup_logging
from runner.records import RunManifest
from runner.rundir import EXIT_PREFLIGHT, EXIT_REQUEUE, EXIT_TERMINATED, STANDBY_ENV, RunDir, atomic_write
from runner.spec.typed import Trainer as TrainerConfig
from runner.spec.typed import read_resolved

log = logging.getLogger("runner.job.launch")  # not __name__: run with -m, this module is __main__


def instantiate(spec: dict[str, Any], **offered: Any) -> Any:
    """Build ``_target_(**kwargs)``; extra arguments are passed only if the target accepts them."""
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    mod_name, _, attr = spec["_target_"].rpartition(".")
    target = getattr(importlib.import_module(mod_name), attr)
    params = inspect.signature(target).parameters
    for key, value in offered.items():
        if key in params and key not in kwargs:
            kwargs[key] = value
    return target(**kwargs)


TRAINER_OBJECTS = ("callbacks", "logger", "plugins", "profiler")  # runner.spec.schema.TRAINER_OBJECTS


def built(value: Any) -> Any:
    """A Trainer object argument as the config gives it, built: ``_target_`` mappings instantiated, lists item by item
    (``logger: false``, ``profiler: simple`` as they are)."""
    if isinstance(value, dict) and "_target_" in value:
        return instantiate(value)
    if isinstance(value, list):
        return [built(v) for v in value]
    return value


def _listed(value: Any) -> list[Any]:
    return [] if value is None else value if isinstance(value, list) else [value]


def code_path(manifest: RunManifest) -> None:
    """Put the config's directory first on ``sys.path``: a ``_target_`` module is found where ``validate`` found it
    (beside the config), whatever directory the run was started from. Not where the directory is not here (an
    image that holds the code elsewhere: ``container.code``, under its workdir)."""
    where = Path(manifest.get("config_file") or "").parent
    if manifest.get("config_file") and where.is_dir() and str(where) not in sys.path:
        sys.path.insert(0, str(where))


def _redirect_output(path: Path) -> None:
    """One log file per rank and attempt: everything this process and its children print goes there. What Python
    code in this process prints (the program's ``print``, a traceback) passes ``redaction.Scrubbed`` on its way:
    the secrets this rank knows (``env:``'s, ``alerts.url_file``'s, any Slack webhook URL) never reach the file from
    there. A child process and C code write to the file itself."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = redaction.Scrubbed(io.TextIOWrapper(os.fdopen(1, "wb", 0), line_buffering=True))
    sys.stderr = redaction.Scrubbed(io.TextIOWrapper(os.fdopen(2, "wb", 0), line_buffering=True))


def _reached_end(trainer: Any, tcfg: TrainerConfig) -> bool:
    if tcfg["max_steps"] > 0 and trainer.global_step >= tcfg["max_steps"]:
        return True
    max_epochs = tcfg["max_epochs"]
    return max_epochs is not None and max_epochs > 0 and trainer.current_epoch >= max_epochs


def _write_rank_info(rd: RunDir, manifest: RunManifest, rank: int, local: int, node: int, world: int,
                     attempt: int) -> None:
    info = {"rank": rank, "local_rank": local, "node_rank": node, "world_size": world, "attempt": attempt,
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "slurm": {k: v for k, v in os.environ.items() if k in (
                "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_NTASKS",
                "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES")},
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "ifname": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), **container.describe(manifest)}
    atomic_write(rd.rank_record(rank), json.dumps(info, indent=2))


def train(rd: RunDir) -> int:
    """Run this rank's training (runner's own mode) or the config's program (``command:``); returns the exit code."""
    cfg = read_resolved(rd.config)
    for name in redaction.webhook_names(cfg):  # a second wall: a site whose srun exports the batch shell's variables
        os.environ.pop(name, None)
    # The signal handlers first of all: Slurm may send the time-limit signal seconds after the job starts (its
    # timer has a 60 s grain), and a rank without a handler dies of it (SIGUSR2's default) instead of stopping
    # at its first step with a checkpoint.
    flag = stop_flag(cfg["slurm"]["signal"])
    manifest = rd.manifest_record()
    if manifest is None:  # runner resume refuses such a run; a rank started by hand says so in one line
        raise RunnerError(f"{rd.manifest}: found no readable JSON object; expected the manifest runner submit "
                          f"wrote. hint: restore it, or submit the config again: runner submit {rd.config}")
    rank, local, node, world = jobenv.current().ranks()
    attempt = current_attempt(rd)
    _redirect_output(rd.rank_log(rank, attempt))
    setup_logging(stamped=True)  # a rank log is read later, next to other ranks' logs: every line has its time
    log.info("runner %s: rank %d/%d local %d node %d on %s, attempt %d", __version__, rank, world, local, node,
             socket.gethostname(), attempt)
    if (pending := rd.signal_ready(attempt, rank)) is not None:  # it came before the handlers: stop all the same
        flag.set(getattr(signal, f"SIG{pending}"))
    from runner.job import netenv, preflight, program, targets

    # The NCCL/gloo environment before anything else: the interface is detected once on this node (names differ
    # between nodes) unless the config names it; rank 0 records every value in env.json.
    ne = netenv.setup(cfg, rd, rank)
    _write_rank_info(rd, manifest, rank, local, node, world, attempt)
    if container.stale_image(manifest, cfg["resume"]["force"], rd if rank == 0 else None):
        return EXIT_PREFLIGHT
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command = cfg["command"]
    # A command that cannot start: one line, before the preflight builds a process group. Whether its packages are
    # here is the preflight's check (it names the Python in its report), or this one's where no preflight runs.
    if command and (code := program.prepare(rd, command, manifest, rank, not preflight.runs(cfg))) is not None:
        return code

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # The preflight checks run before Lightning is imported: a bad node or interface stops the job here (exit 77),
    # before any step. When they pass, the process group they measured in is the training's (Lightning finds
    # torch.distributed initialized): one rendezvous and one group for the job, not two. Not in a thread beside the
    # import: measured, they took 3-4x longer there (the import holds the GIL, and with fewer cores than ranks
    # the CPU), ended after the import anyway, and timed the probe against the other ranks' imports. A program
    # builds its own group (torch refuses a second init_process_group), so for it the group is taken down.
    code = preflight.in_job(rd, cfg, rank, local, node, world, ne, keep_group=not command)
    if code is not None:  # a failed check, or `runner preflight` (the checks alone, without Lightning's imports)
        return code
    if command:
        return program.run(rd, cfg, command, (rank, local, node, world), attempt)
    import lightning as L

    from runner.job import honesty, internals
    from runner.job.callback import Guarantees

    if torch.distributed.is_initialized():
        log.info("training in the preflight's process group (%s, %d ranks)", torch.distributed.get_backend(),
                 torch.distributed.get_world_size())
        internals.set_pg_timeout(cfg["network"]["pg_timeout_s"])  # the preflight's short one gives way

    code_path(manifest)
    code = targets.check(cfg)  # every _target_ imports here, in the image (the login node only read the source)
    if code is not None:
        return code
    L.seed_everything(cfg["seed"] + rank, workers=True, verbose=False)
    model = instantiate(cfg["model"])
    data = instantiate(cfg["data"], dataloader=cfg["dataloader"], seed=cfg["seed"])
    g = Guarantees(rd, cfg, manifest["config_hash"], flag, rank, world, attempt,
                   honesty.configured_batch(cfg, world))
    plugins: list[Any] = []
    if jobenv.current().under_slurm:
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=False))
    tcfg: dict[str, Any] = {k: v for k, v in cfg["trainer"].items() if k != "strategy"}  # + open arguments
    user = {k: built(tcfg.pop(k)) for k in TRAINER_OBJECTS if k in tcfg}  # the user's, beside runner's own
    plugins += _listed(user.pop("plugins", None))
    callbacks = [g.callback, *_listed(user.pop("callbacks", None))]
    logger = user.pop("logger", False)
    strategy = internals.strategy(cfg["trainer"]["strategy"], cfg["checkpoint"]["exact_resume"],
                                  cfg["network"]["pg_timeout_s"], world, cfg["fsdp"]["blocks"])
    trainer = L.Trainer(**tcfg, **user, strategy=strategy, plugins=plugins, callbacks=callbacks,
                        enable_checkpointing=False, logger=logger, default_root_dir=str(rd.root),
                        use_distributed_sampler=False)
    code = g.fit(trainer, lambda ckpt: trainer.fit(model, datamodule=data, ckpt_path=ckpt))
    if code is not None:
        return code
    if not _reached_end(trainer, cfg["trainer"]):
        log.warning("training stopped at step %d before its end", trainer.global_step)
        return EXIT_TERMINATED
    g.save_final(trainer)
    trainer.strategy.barrier("runner-final")
    if rank == 0:
        outcome.finished(rd, trainer.global_step, g.checkpoint.productive())
    log.info("finished at step %d", trainer.global_step)
    return 0


def _release_process_group() -> None:
    """Destroy the process group this rank's training (or the program) left alive. An interpreter that exits with a
    gloo group alive can die in its C++ teardown with SIGABRT ("terminate called without an active exception",
    pytorch/pytorch#190489): a rank that stopped cleanly with exit 75 then ends 134, and its stop reads as a crash."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.job.launch", description=__doc__)
    parser.add_argument("run_dir", nargs="?", type=Path)
    parser.add_argument("--version", action="store_true")
    args = parser.parse_args(argv)
    if args.version or args.run_dir is None:
        print(f"runner {__version__}")
        return 0
    rd = RunDir(args.run_dir.resolve())
    if os.environ.get(STANDBY_ENV):  # resume.in_job's warm standby: a rank of the next attempt, or nothing
        from runner.job import standby

        if not standby.wait(Path(os.environ.pop(STANDBY_ENV))):
            return 0
    env = jobenv.current()
    code = 1  # an exception's, after its traceback
    try:
        code = train(rd)
        if env.rank == 0:
            # srun reports 143 when --kill-on-bad-exit ends the ranks that were still exiting; this file keeps
            # the code all ranks agreed on, for the batch script's exit hook.
            rd.write_last_exit(code, env.job_id, env.restart_count)
        if code in (0, EXIT_REQUEUE):  # every rank agreed to end here, so none waits on another's group
            _release_process_group()
        return code
    finally:  # whatever ended it: the step reaper (runner.host.jobhook.reap) reads it
        rd.write_rank_exit(env.rank, env.attempt, code)


def exit_now(code: int) -> None:
    """End the rank with ``code`` after Python's own exit work (atexit handlers: logging, loggers; stdio flushed) but
    without the interpreter's C++ teardown, where a gloo thread still joinable aborts the process ("terminate called
    without an active exception", pytorch/pytorch#190489) and a clean stop (75) would read as a crash (134)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def run_main() -> None:
    """``main`` as the rank's process: an exception's traceback as Python prints it (torch's hook puts the rank before
    each line), then exit 1 through ``exit_now``. The interpreter's own exit after an exception tears the gloo group
    down in C++: measured 1.35 s for a rank whose peer had died, every second of it before srun can end the step and
    the next attempt (resume.in_job) start."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 -- told as Python tells it; SystemExit and KeyboardInterrupt go their own way
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


if __name__ == "__main__":
    run_main()
