"""A program's optimizer steps, seen with no edit of it: torch's public global hooks on every optimizer's ``step``
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` and ``..._post_hook``), which a plain torch loop, Fabric's
and Accelerate's wrapped optimizers all go through.

Before the first step the world is checked: a program that trains with runner's ranks must do it in one process
group of all of them. One that never initialized torch.distributed (an unedited ``Fabric(devices=1)``, a script that
forgot ``init_process_group``) or made a group of another size would train separate copies; it stops there on every
rank with one line and EXIT_PROGRAM, as a Trainer of the wrong size does (``program_entry.check_world``). After each
step, the step goes to ``runner.steps.automatic``: the watchdog, step timings and progress of a program that does not
call ``runner.progress`` itself. While runner's callback drives a Lightning fit (``StopFlag.driving``) the hooks do
nothing: the callback checks the Trainer and sees its steps.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from runner.job.stopflag import StopFlag
from runner.rundir import EXIT_PROGRAM, RunDir
from runner.spec.typed import RunConfig

log = logging.getLogger("runner.job.callback")  # rank logs name runner's in-process lines this way


def world_problem(world: int, group: int | None) -> str | None:
    """Why a first optimizer step in a process group of ``group`` ranks (None: torch.distributed not initialized)
    is not training runner's ``world``, or None."""
    if world <= 1 or group == world:
        return None
    if group is None:
        return (f"the program's first optimizer step came with no process group (torch.distributed not initialized): "
                f"its {world} ranks would train {world} separate copies")
    return f"the program's first optimizer step ran in a process group of {group} ranks; runner started {world}"


class StepHook:
    """The two hooks of one rank: the world check at the first step, the automatic progress after each."""

    def __init__(self, rd: RunDir, cfg: RunConfig, flag: StopFlag, rank: int, world: int) -> None:
        self.rd, self.cfg, self.flag, self.rank, self.world = rd, cfg, flag, rank, world
        self.first: int | None = None  # the optimizer whose steps are counted (a GAN's second one is not)
        self.steps = 0
        self.handles: list[Any] = []
        # runner.steps (the public ``runner.progress``) imports job code at its first call: imported here by name,
        # at run time, the two meet without a cycle between the rooms.
        try:
            steps: Any = importlib.import_module("runner.steps")
        except ImportError:
            steps = None
        self.automatic = getattr(steps, "automatic", None)

    def install(self) -> StepHook:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles = [register_optimizer_step_pre_hook(self.before), register_optimizer_step_post_hook(self.after)]
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.first is not None or self.flag.driving:
            return None
        self.first = id(optimizer)
        import torch.distributed as dist

        group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        why = world_problem(self.world, group)
        if why is None:
            return None
        cfg = self.cfg
        log.error("program: %s. hint: train in one process group of every rank: init_process_group() reads runner's "
                  "RANK and WORLD_SIZE; Fabric and Trainer with devices=%d and num_nodes=%d (or left out for Fabric)",
                  why, cfg["num_device"], cfg["num_nodes"])
        if self.rank == 0:
            self.rd.record("program_error", reason="world_size", detail=why)
        raise SystemExit(EXIT_PROGRAM)

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.flag.driving or id(optimizer) != self.first:
            return
        self.steps += 1
        if self.automatic is not None:
            self.automatic(self.steps)


def install(rd: RunDir, cfg: RunConfig, flag: StopFlag, rank: int, world: int) -> StepHook:
    """The hooks, for the program this process runs (removed when it ends)."""
    return StepHook(rd, cfg, flag, rank, world).install()
