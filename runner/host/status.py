"""Read the state of runs: the run directory's own records first, the scheduler second."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.host.jobhook import restarts_used
from runner.job import checkpoint
from runner.rundir import EXIT_REQUEUE, RunDir, read_json


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
    if run.cancelled_now():
        return "cancelled"
    if status is None or (events and events[-1]["event"] in ("submitted", "resubmitted", "start")):
        return "running" if any(e["event"] in ("start", "train_start") for e in events[-3:]) else "pending"
    code = status.get("exit_code")
    if code == EXIT_REQUEUE:
        return "preempted"
    return "cancelled" if status.get("cancelled") else "failed"


def _job_alive(events: list[dict[str, Any]]) -> bool:
    """The batch script started and has not recorded its exit yet (training may be done, the job is not)."""
    for e in reversed(events):
        if e["event"] == "exit":
            return False
        if e["event"] in ("start", "submitted", "resubmitted"):
            return True
    return False


def _exit_code(value: str | None) -> int | None:
    """Slurm's "75:0" (exit code : signal) -> 75."""
    head = (value or "").split(":")[0]
    return int(head) if head.isdigit() else None


def combine(local: str, job: Any) -> str:
    """Slurm's view of the job, corrected by the run directory's own records.

    Slurm knows whether a job is pending or running; the run directory knows whether training finished
    (the ``finished`` marker: a job that exits 0 after SIGTERM is COMPLETED to Slurm but did not finish)
    and whether it stopped to be requeued (exit code 75). When Slurm has forgotten the job (no accounting,
    older than MinJobAge), the run directory's exit status is all there is.
    """
    if local == "completed" or job is None:
        return local
    state: str | None = job.runner_state
    if state is None:
        return local
    if not job.terminal:
        return state
    if _exit_code(job.exit_code) == EXIT_REQUEUE or local == "preempted":
        return "preempted"
    if state == "completed":  # the batch script exited 0 but the launcher never wrote `finished`
        return "failed"
    return state


def row(run: RunDir) -> dict[str, Any]:
    manifest = read_json(run.manifest, {})
    cfg_hash = manifest.get("config_hash")
    last = checkpoint.latest(run.checkpoints, cfg_hash) if run.checkpoints.is_dir() else None
    events = run.events()
    state = local_state(run)
    job = run.job_id()
    info = None
    if job and manifest.get("scheduler") == "slurm" and (state != "completed" or _job_alive(events)):
        from runner.host import slurm

        info = slurm.query(job)
        state = combine(state, info)
    return {"run": run.name, "path": str(run.root), "state": state, "job_id": job,
            "last_checkpoint_step": last[0] if last else None,
            "restarts": restarts_used(run),
            "age_s": round(time.time() - manifest.get("created", time.time()), 1),
            "last_event": events[-1]["event"] if events else None,
            **history(run, events, manifest, last),
            **({"slurm_state": info.state, "slurm_source": info.source, "slurm_exit_code": info.exit_code,
                "reason": info.reason, "nodes": info.nodes} if info else {})}


def history(run: RunDir, events: list[dict[str, Any]], manifest: dict[str, Any],
            last: tuple[int, Path] | None) -> dict[str, Any]:
    """What the failures cost: the last outcome and its cause, steps lost per restart, and goodput.

    Goodput is training time kept in checkpoints (or in the finished run) divided by wall time since submit.
    """
    exits = [e for e in events if e["event"] == "exit" and e.get("outcome")]
    done = read_json(run.finished, None)
    kept = (done or {}).get("productive_s")
    if kept is None and last is not None:
        kept = (read_json(last[1] / "manifest.json", {}) or {}).get("productive_s")
    end = (done or {}).get("time") or time.time()
    wall = end - manifest.get("created", end)
    return {"last_outcome": exits[-1]["outcome"] if exits else None,
            "last_cause": exits[-1].get("cause") if exits else None,
            "lost_steps": [e.get("lost_steps", 0) for e in events if e["event"] == "train_start"][1:],
            "goodput": round(kept / wall, 3) if kept is not None and wall > 0 else None}


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
    cols = ("run", "state", "job_id", "last_checkpoint_step", "restarts", "lost_steps", "goodput", "last_outcome",
            "age")
    data = [[str(r.get(c) if c != "age" else _age(r["age_s"])) if r.get(c, "") is not None else "-" for c in cols]
            for r in rows]
    for r, d in zip(rows, data, strict=True):
        if r["state"] == "pending" and r.get("reason"):  # Slurm's reason: Resources, Priority, BeginTime, ...
            d[1] = f"pending ({r['reason']})"
        d[5] = ",".join(map(str, r["lost_steps"])) or "-"
        d[6] = f"{r['goodput']:.0%}" if r.get("goodput") is not None else "-"
        if r.get("last_cause"):
            d[7] = f"{d[7]}: {r['last_cause'][:60]}"
    heads = ("RUN", "STATE", "JOB", "CKPT", "RESTARTS", "LOST", "GOODPUT", "LAST", "AGE")
    widths = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*heads), *(fmt.format(*d) for d in data)])


def ended(run: RunDir) -> bool | None:
    """Nothing more will be written to the logs (until a resubmission): finished, exited or cancelled.

    None when Slurm does not know the job (any more, or its commands failed): the caller decides how long
    to believe that, since a controller restart or a network blip looks the same.
    """
    if run.finished.exists():
        return True
    events = run.events()
    if events and events[-1]["event"] in ("exit", "cancelled", "finished", "gave_up"):
        return True
    job = run.job_id()
    if job and (read_json(run.manifest, {}) or {}).get("scheduler") == "slurm":
        from runner.host import slurm

        info = slurm.query(job)
        return None if info is None else info.terminal
    return False


def log_path(run: RunDir, rank: int | None) -> Path:
    """A rank's log, or with ``rank=None`` Slurm's batch output (``slurm-JOB.out``: the batch shell, hooks)."""
    if rank is not None:
        return run.rank_log(rank)
    job = run.job_id()
    if job:
        return run.logs / f"slurm-{job}.out"
    outs = sorted(run.logs.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime)
    return outs[-1] if outs else run.logs / "slurm-JOB.out"


def logs(run: RunDir, rank: int | None, follow: bool, poll_s: float = 0.2) -> int:
    """Print a log; with ``follow``, keep printing until the run ends (waiting for the log to appear)."""
    path = log_path(run, rank)
    what = f"rank {rank}" if rank is not None else "the batch script"
    if not path.exists():
        if not follow:
            have = sorted(p.name for p in run.logs.glob("*")) if run.logs.is_dir() else []
            raise RunnerError(f"{path}: found no log for {what}; expected one of {have or 'none yet'}. "
                              "hint: --follow waits for it; --batch shows Slurm's output of the batch script")
        print(f"runner: waiting for {path} ...", file=sys.stderr, flush=True)
    check_every = max(1, int(2.0 / poll_s))
    polls = unknown = 0
    f = None
    try:
        while True:
            if f is None and path.exists():
                f = open(path, errors="replace")  # held open while following
            chunk = f.read() if f is not None else ""
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            if not follow:
                return 0
            polls += 1
            done = ended(run) if not chunk and polls % check_every == 0 else False
            unknown = unknown + 1 if done is None else 0
            if done or unknown >= 5:  # Slurm has not known the job for ~10 s: it is gone
                if f is not None:
                    sys.stdout.write(f.read())  # what was written between the last read and the end
                    sys.stdout.flush()
                return 0
            if not chunk:
                time.sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def cancel(run: RunDir, wait_s: float = 30) -> int:
    """Cancel the run's Slurm job (every rank gets SIGTERM) and wait until Slurm says it ended.

    The ``cancelled`` marker is written first: the batch script's exit hook and ``runner cron`` read it and
    must not requeue or resubmit a job the user cancelled, however its launcher exited.
    """
    from runner.rundir import atomic_write

    job = run.job_id()
    manifest = read_json(run.manifest, {}) or {}
    if run.finished.exists():
        print(f"run {run.name} already finished; nothing to cancel")
        return 0
    atomic_write(run.cancelled, json.dumps({"job_id": job, "time": time.time()}) + "\n")
    run.record("cancelled", job_id=job)
    if job and manifest.get("scheduler") == "slurm":
        from runner.host import slurm

        complaint = slurm.cancel(job)
        deadline = time.monotonic() + wait_s
        info = slurm.query(job)
        while info is not None and not info.terminal and time.monotonic() < deadline:
            time.sleep(0.25)
            info = slurm.query(job)
        state = info.state if info else "unknown to Slurm"
        note = f"; scancel said: {complaint}" if complaint else ""
        print(f"cancelled {run.name} (job {job}: {state}){note}")
        return 0
    status = read_json(run.exit_status, {}) or {}
    atomic_write(run.exit_status, json.dumps({**status, "cancelled": True, "time": time.time()}) + "\n")
    print(f"cancelled {run.name}" + (f" (job {job})" if job else ""))
    return 0
