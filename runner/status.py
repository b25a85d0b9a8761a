"""Read the state of runs: the run directory's own records first, the scheduler second."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runner import checkpoint
from runner.errors import RunnerError
from runner.rundir import EXIT_REQUEUE, RunDir, read_json

STATES = ("pending", "running", "completed", "failed", "cancelled", "timeout", "preempted")


def find_run(name: str, root: Path) -> RunDir:
    """A run by path, by directory name under root, or by name prefix (the newest match)."""
    for cand in (Path(name), root / name):
        if (cand / "config.yaml").is_file():
            return RunDir(cand.resolve())
    matches = sorted(p for p in root.glob(f"{name}*") if (p / "config.yaml").is_file()) if root.is_dir() else []
    if not matches:
        raise RunnerError(f"run {name!r}: found no run directory under {root}/; expected a path or a run name. "
                          "hint: `runner status` lists runs")
    return RunDir(matches[-1].resolve())


def local_state(run: RunDir) -> str:
    """State from the run directory alone (the last word for local runs and when the scheduler forgot)."""
    if run.finished.exists():
        return "completed"
    status = read_json(run.exit_status)
    events = run.events()
    if status is None or (events and events[-1]["event"] in ("submitted", "resubmitted", "start")):
        return "running" if any(e["event"] in ("start", "train_start") for e in events[-3:]) else "pending"
    code = status.get("exit_code")
    if code == EXIT_REQUEUE:
        return "preempted"
    return "cancelled" if status.get("cancelled") else "failed"


def row(run: RunDir) -> dict[str, Any]:
    manifest = read_json(run.manifest, {})
    cfg_hash = manifest.get("config_hash")
    last = checkpoint.latest(run.checkpoints, cfg_hash) if run.checkpoints.is_dir() else None
    events = run.events()
    state = local_state(run)
    from runner import slurm

    job = run.job_id()
    if job and state not in ("completed",) and manifest.get("scheduler") == "slurm":
        state = slurm.job_state(job) or state
    return {"run": run.name, "path": str(run.root), "state": state, "job_id": job,
            "last_checkpoint_step": last[0] if last else None,
            "restarts": sum(1 for e in events if e["event"] in ("resubmitted", "requeued")),
            "age_s": round(time.time() - manifest.get("created", time.time()), 1),
            "last_event": events[-1]["event"] if events else None}


def collect(name: str | None, root: Path) -> list[dict[str, Any]]:
    if name:
        return [row(find_run(name, root))]
    runs = sorted(p for p in root.glob("*") if (p / "config.yaml").is_file()) if root.is_dir() else []
    return [row(RunDir(p.resolve())) for p in runs]


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs"
    cols = ("run", "state", "job_id", "last_checkpoint_step", "restarts", "age")
    data = [[str(r.get(c) if c != "age" else _age(r["age_s"])) if r.get(c, "") is not None else "-" for c in cols]
            for r in rows]
    heads = ("RUN", "STATE", "JOB", "CKPT", "RESTARTS", "AGE")
    widths = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*heads), *(fmt.format(*d) for d in data)])


def logs(run: RunDir, rank: int, follow: bool) -> int:
    path = run.rank_log(rank)
    if not path.exists():
        raise RunnerError(f"{path}: found no log for rank {rank}; expected one of "
                          f"{sorted(p.name for p in run.logs.glob('rank-*.log')) or 'none yet'}")
    with open(path, errors="replace") as f:
        print(f.read(), end="")
        while follow and not run.finished.exists():
            line = f.readline()
            if line:
                print(line, end="", flush=True)
            else:
                time.sleep(0.5)
    return 0


def cancel(run: RunDir) -> int:
    from runner import slurm

    job = run.job_id()
    if job:
        slurm.cancel(job)
    status = read_json(run.exit_status, {}) or {}
    from runner.rundir import atomic_write

    atomic_write(run.exit_status, json.dumps({**status, "cancelled": True, "time": time.time()}) + "\n")
    run.record("cancelled", job_id=job)
    print(f"cancelled {run.name}" + (f" (job {job})" if job else ""))
    return 0
