"""Where an attempt's ranks start: the attempt they belong to, and the checkpoint they all resume from.

Standard library only (the launcher reads the attempt before torch is imported).
"""

from __future__ import annotations

import time
from pathlib import Path

from runner import checkpoint
from runner.job import jobenv
from runner.records import ResumeVerdict
from runner.rundir import RunDir
from runner.spec.typed import RunConfig


def current_attempt(rd: RunDir) -> int:
    """The attempt whose ranks these are, as claimed by whoever started them (``RUNNER_ATTEMPT``).

    A rank never claims one itself: every rank would claim its own. Started by hand without the variable, a
    rank joins the latest attempt (or the first).
    """
    claimed = jobenv.current().attempt
    return claimed if claimed is not None else (rd.attempts() or [1])[-1]


def resume_point(rd: RunDir, cfg: RunConfig, cfg_hash: str, rank: int, attempt: int,
                 tried: int = 0) -> tuple[int, Path] | None:
    """The newest complete, verified checkpoint a resume can continue from (``checkpoint.latest``'s ``positioned``):
    rank 0 hashes the files, the other ranks wait for its verdict.

    One reader instead of one per rank (a shared file system would serve the whole checkpoint world-size
    times). The verdict names its attempt and job, so a verdict left by an earlier attempt is never taken, and
    ``tried``, the checkpoints of this attempt that failed to load before it (``runner.job.fallback``), so that the
    choice after such a failure is never taken for the one before it.
    """
    env = jobenv.current()
    if rank == 0:
        last = checkpoint.latest(rd.checkpoints, cfg_hash, cfg["resume"]["force"], check=True, positioned=True,
                                 world=env.world_size)
        verdict: ResumeVerdict = {"attempt": attempt, "job": env.job_id, "restart": env.restart_count,
                                  "step": last[0] if last else None, "path": str(last[1]) if last else None,
                                  "tried": tried}
        rd.write_resume_verdict(verdict)
        return last
    deadline = time.monotonic() + cfg["network"]["pg_timeout_s"]
    while time.monotonic() < deadline:
        got = rd.resume_verdict_record()
        if got is not None and (got["attempt"], got["job"], got["restart"], got["tried"]) == \
                (attempt, env.job_id, env.restart_count, tried):
            return (got["step"], Path(got["path"])) if got["step"] is not None and got["path"] else None
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 gave no checkpoint verdict in {rd.resume_verdict} within "
                       f"{cfg['network']['pg_timeout_s']} s")
