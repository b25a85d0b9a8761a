"""A checkpoint that verified yet failed to load is skipped for the previous complete one, as a damaged one is.

A checkpoint's files can match a manifest that is itself wrong (two FSDP shards swapped with their digests), or hold
a state that no longer loads: every resume from it crashed and the previous good checkpoint was never tried.
``LoadWatch`` sees whether ``fit`` failed while Lightning read runner's checkpoint or applied it (its checkpoint
connector's restore, ``internals.watch_restore``), and makes the ranks agree: each says once, in one reduction,
whether it loaded (at the restore's end), failed on the checkpoint, or failed otherwise (memory, the network: the
machine's trouble, not the checkpoint's, which stays a crash). When any rank failed on the checkpoint and none
otherwise, every rank's ``fit`` ends (one that loaded raises ``PeerFailed``), rank 0 marks the checkpoint
(``checkpoint.mark_unloadable``: ``verify`` skips it from then on, so no resume tries it twice and none loops) and
records ``checkpoint_unloadable`` in the ledger, and ``Guarantees.fit`` resumes from the previous one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner import checkpoint
from runner.job import internals
from runner.log import one_line
from runner.rundir import RunDir

log = logging.getLogger(__name__)
LOADED, BAD, OTHER = 0, 1, 2  # a rank's word after the restore; the reduction takes the worst (MAX)
# Failures of the machine, not of the checkpoint: never a reason to skip one.
MACHINE: tuple[type[BaseException], ...] = (MemoryError, torch.OutOfMemoryError, TimeoutError, dist.DistError,
                                            KeyboardInterrupt, SystemExit)


class PeerFailed(RuntimeError):
    """Raised at the restore's end on a rank that loaded the checkpoint when another did not."""


class LoadWatch:
    """Watches one ``fit`` from runner's checkpoint on ``trainer`` (every rank makes one, or none)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loading = False  # inside a step that reads or applies the checkpoint (set by internals.watch_restore)
        self.agreed: int | None = None  # the ranks' word, once said
        internals.watch_restore(trainer, self)

    def loaded(self) -> None:
        """The restore ended on this rank: its word is LOADED; it fails too when another rank's is not."""
        if self.agreed is not None:  # a later restore of the same Trainer (the program's validate after fit)
            return
        if self.agree(LOADED) != LOADED:
            raise PeerFailed("another rank failed to load runner's checkpoint; this rank stops with it")

    def failed(self, e: BaseException) -> str | None:
        """After ``fit`` raised ``e``: why runner's checkpoint failed to load (agreed on every rank), or None when
        ``fit`` failed otherwise (the crash it was)."""
        internals.watch_restore(self.trainer, None)
        if isinstance(e, PeerFailed):
            return "another rank failed to load it" if self.agreed == BAD else None
        if self.agreed is not None or not self.loading:  # after the restore: a crash of training
            return None
        word = OTHER if _machine(e) else BAD
        if self.agree(word) != BAD:
            return None
        return _why(e)

    def agree(self, word: int) -> int:
        """Every rank's word reduced (MAX), once; this rank's alone without a process group. A reduction that fails
        is OTHER: the group is broken, a crash, never a reason to skip the checkpoint."""
        self.agreed = word
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return word
        try:
            buf = torch.tensor([word], dtype=torch.int64, device=self.trainer.strategy.root_device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            self.agreed = int(buf.item())
        except Exception as e:  # noqa: BLE001 -- the group's own failure: said, and a crash as before
            log.warning("the ranks could not agree whether runner's checkpoint loaded: %s", one_line(e))
            self.agreed = OTHER
        return self.agreed


def _machine(e: BaseException) -> bool:
    """A failure of the machine (memory, the network, an interrupt) rather than of the checkpoint, also inside DCP's
    exception that gathers every rank's."""
    inner = getattr(e, "failures", None)
    if isinstance(inner, dict) and inner:  # torch.distributed.checkpoint's CheckpointException: rank -> (exc, tb)
        return any(isinstance(pair[0], MACHINE) for pair in inner.values() if isinstance(pair, tuple) and pair)
    return isinstance(e, MACHINE) or isinstance(e.__cause__, MACHINE)


def _why(e: BaseException) -> str:
    """The failure in one line; DCP's gathered one by its first failing rank's exception."""
    inner = getattr(e, "failures", None)
    if isinstance(inner, dict) and inner:
        rank, pair = sorted(inner.items())[0]
        if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
            return f"rank {rank}: {one_line(pair[0], 200)}"
    return one_line(e, 200)


def skip(rd: RunDir, rank: int, step: int, path: Path, why: str) -> None:
    """Every rank, after the ranks agreed the checkpoint at ``path`` failed to load: rank 0 marks it and records it;
    every rank says it in its log."""
    log.error("checkpoint %s (step %d) verified but failed to load: %s; resuming from the previous complete one",
              path, step, why)
    if rank == 0:
        checkpoint.mark_unloadable(path, why)
        rd.record("checkpoint_unloadable", step=step, path=str(path), why=why)
