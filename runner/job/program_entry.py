"""Program mode's door into runner: the callback in the user's own Trainer, and its ``fit`` resumed.

The program builds its own Trainer, and Lightning adds the callbacks that the factories of the entry-point group
``lightning.pytorch.callbacks_factory`` return (inside ``Trainer.__init__``, so Lightning is fully imported by
then): ``factory`` is runner's, and returns the callback only in a process that runner's launcher started for a
run (``PROGRAM_ENV``), nothing anywhere else. The resume door is ``Trainer.fit`` itself, wrapped once per process
(``wrap_fit``): runner's newest complete checkpoint wins over the program's own ``ckpt_path`` (and over Lightning's
``hpc_ckpt``), which is used only while runner has none.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L

from runner.job import internals, jobenv
from runner.job.callback import Guarantees, RunnerCallbacks
from runner.job.resume import current_attempt
from runner.job.stopflag import stop_flag
from runner.log import setup as setup_logging
from runner.rundir import EXIT_PROGRAM, RunDir
from runner.spec.typed import RunConfig, read_resolved

log = logging.getLogger("runner.job.callback")  # rank logs name these lines runner's callback's, as before the split


def factory() -> list[L.Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: runner's callback for a Trainer built by a program
    that runner's launcher runs (``PROGRAM_ENV`` names the run), nothing in any other process."""
    run_dir = jobenv.program_run_dir()
    if not run_dir:
        return []
    rd = RunDir(Path(run_dir))
    cfg = read_resolved(rd.config)
    flag = stop_flag(cfg["slurm"]["signal"])
    if not logging.getLogger("runner").handlers:  # a program's own process: runner's lines stamped, as the launcher's
        setup_logging(stamped=True)
    env = jobenv.current()
    rank, world = env.rank, env.world_size
    manifest = rd.manifest_record() or {}
    g = Guarantees(rd, cfg, manifest.get("config_hash", ""), flag, rank, world, current_attempt(rd), None,
                   extra=[ProgramSetup(cfg)])
    wrap_fit()
    return [g.callback]


class ProgramSetup(L.Callback):
    """The part only a program's Trainer needs, at its ``setup`` (before the strategy wraps the model): plain DDP
    gets the one bucket layout of exact resume."""

    def __init__(self, cfg: RunConfig) -> None:
        self.exact_resume = cfg["checkpoint"]["exact_resume"]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.exact_resume:
            done = internals.fix_bucket_layout(trainer.strategy)
            if done:
                log.info("exact resume: the program's DDP gets %s", done)


def check_world(trainer: L.Trainer, g: Guarantees) -> None:
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


def _guarantees(trainer: L.Trainer) -> Guarantees | None:
    """The guarantees whose callback ``trainer`` carries (runner's factory added it), if any."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # public, but set by its connector, not declared
    return next((cb.runner for cb in callbacks if isinstance(cb, RunnerCallbacks) and cb.runner), None)


def wrap_fit() -> None:
    """Wrap ``Trainer.fit`` (public, and stable across Lightning 2.x) once per process: a Trainer that carries
    runner's callback fits through ``Guarantees.fit``; any other Trainer fits as before."""
    original = L.Trainer.fit
    if getattr(original, "runner_wrapped", False):
        return
    signature = inspect.signature(original)
    fits: list[int] = []

    @functools.wraps(original)
    def fit(self: L.Trainer, *args: Any, **kwargs: Any) -> None:
        g = _guarantees(self)
        if g is None:
            return original(self, *args, **kwargs)
        check_world(self, g)
        fits.append(1)
        if len(fits) > 1:  # runner's checkpoints resume one fit; a second one is the program's own business
            log.warning("this program calls fit a second time: runner does not resume it from its checkpoints")
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)

        def call(ckpt: str | None) -> None:
            bound.arguments["ckpt_path"] = ckpt
            original(*bound.args, **bound.kwargs)

        code = g.fit(self, call, bound.arguments.get("ckpt_path"))
        g.rd.write_program_outcome(g.attempt, g.rank, {
            "step": int(self.global_step), "code": code, "resumed": g.checkpoint.resume_from is not None,
            "time": time.time(), "productive_s": g.checkpoint.productive()})
        if code is not None:
            raise SystemExit(code)  # the program's code after fit runs in the attempt that finishes training
        g.save_final(self)
        with contextlib.suppress(Exception):
            self.strategy.barrier("runner-final")

    fit.runner_wrapped = True  # type: ignore[attr-defined]
    L.Trainer.fit = fit  # type: ignore[method-assign]
