"""Run directories for the report's tests and bench/report, written by runner's own writers.

- ``clean_run``: a local quickstart-shaped run that trained to its end.
- ``fault_run``: a 2-node Slurm-shaped run with a preemption, a killed rank, a hang (its node kept out of the next
  job) and a skipped NaN, then finished. Synthesized, not run: the run directory comes from ``submit.plan`` and
  ``submit.write``, the ledger from ``RunDir.record`` (the batch script's start from ``jobhook.main``),
  checkpoints from ``checkpoint.publish``, the hang summary from ``watchdog.summarize``, the preflight's bandwidth
  checks from ``checks.evaluate_bandwidth``, bad nodes from ``nodes.record``, alerts from ``alerts.notify``; the
  fields of each record are those the job code writes. Real time passes between the phases (short pauses), so
  the page shows real proportions.
- ``thirty_day_run``: the shape of a 30-day run (10,000 checkpoints, 200 attempts, 64 ranks of heartbeats), with
  timestamps spread over 30 days; written without fsyncs (it is large), in the writers' formats.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from runner import alerts, checkpoint, checks
from runner.host import jobhook, nodes, submit
from runner.job import watchdog
from runner.rundir import RunDir, atomic_write
from runner.spec.typed import read_resolved

REPO = Path(__file__).resolve().parents[1]


def plan_run(root: Path, conf: str, *overrides: str) -> RunDir:
    """The run directory ``runner submit`` writes (config, manifest, batch script), without starting it."""
    p = submit.plan(REPO / "conf" / conf, [f"run_root={root}", *overrides], allow_missing_image=True)
    submit.write(p)
    return p.run


def ckpt(rd: RunDir, step: int, productive_s: float, world: int, when: float | None = None) -> None:
    """One complete checkpoint as the ranks write it: files in the staging directory, then rank 0 publishes."""
    staging = checkpoint.CheckpointDir(rd.checkpoints).staging(step)
    staging.mkdir(parents=True, exist_ok=True)
    checkpoint.CheckpointDir.model(staging).write_bytes(b"weights %d" % step)
    for r in range(world):
        checkpoint.CheckpointDir.rng(staging, r).write_bytes(b"rng")
    cfg_hash = json.loads(rd.manifest.read_text())["config_hash"]
    checkpoint.publish(rd.checkpoints, step, {"step": step, "epoch": 0, "config_hash": cfg_hash,
                                              "world_size": world, "time": when or time.time(),
                                              "productive_s": round(productive_s, 3), "mid_epoch": True})


def progress(rd: RunDir, step: int) -> None:
    atomic_write(rd.root / "progress.json", json.dumps({"step": step, "time": time.time()}) + "\n")


def heartbeat(rd: RunDir, rank: int, host: str, step: int, attempt: int, compute_s: float, data_s: float) -> None:
    """What each rank's watchdog thread writes (runner.job.watchdog.Watchdog._heartbeat)."""
    atomic_write(rd.root / "heartbeats" / f"rank-{rank:05d}.json",
                 json.dumps({"rank": rank, "host": host, "pid": 1000 + rank, "step": step, "time": time.time(),
                             "attempt": attempt, "step_s": 0.01, "compute_s": compute_s, "data_s": data_s}))


def preflight(rd: RunDir, hosts: list[str], seconds: float, record: bool = True) -> None:
    """Rank 0's preflight report and its ledger line (runner.job.preflight._finish), bandwidth from the real check."""
    time.sleep(seconds)
    job = {"busbw_gbps": 9.5, "algbw_gbps": 6.3, "size_bytes": 64 << 20, "ranks": 2 * len(hosts)}
    pairs = [{"nodes": hosts, "busbw_gbps": 9.5, "algbw_gbps": 6.3}]
    found = [checks.Check("gpus", h, checks.PASS, "2 visible", "2") for h in hosts]
    found += checks.evaluate_bandwidth(job, pairs, None, 0.5, 0.8)
    summary = f"preflight passed: {len(found)} checks on {len(hosts)} nodes"
    report = {"status": checks.PASS, "summary": summary, "time": time.time(), "duration_s": seconds,
              "world_size": 2 * len(hosts), "checks": [asdict(c) for c in found], "nodes": hosts}
    atomic_write(rd.root / "preflight.txt", summary + "\n")
    if record:
        rd.record("preflight", status=checks.PASS, duration_s=round(seconds, 2), summary=summary)
    atomic_write(rd.preflight, json.dumps(report, indent=2) + "\n")


@contextmanager
def slurm_env(job: str, nodelist: str, restarts: int) -> Any:
    saved = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT")}
    os.environ.update(SLURM_JOB_ID=job, SLURM_JOB_NODELIST=nodelist, SLURM_RESTART_COUNT=str(restarts))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _attempt(rd: RunDir, job: str, nodelist: str, hosts: list[str], restarts: int, queued_s: float,
             from_step: int, lost: int) -> tuple[int, float]:
    """An attempt's start (the batch script's hook), preflight and first step; returns (attempt, train start)."""
    time.sleep(queued_s)
    attempt = rd.new_attempt()
    with slurm_env(job, nodelist, restarts):
        jobhook.main(["start", str(rd.root)])
    for r in range(4):
        atomic_write(rd.root / "ranks" / f"rank-{r:05d}.json",
                     json.dumps({"rank": r, "hostname": hosts[r // 2], "attempt": attempt, "world_size": 4}))
        (rd.attempt_logs(attempt) / f"rank-{r:05d}.log").write_text(f"rank {r} of attempt {attempt}\n")
    preflight(rd, hosts, 0.15)
    time.sleep(0.1)  # startup: imports, rendezvous, loading the checkpoint
    rd.record("train_start", step=from_step, lost_steps=lost, attempt=attempt,
              resumed_from=str(checkpoint.CheckpointDir(rd.checkpoints).step(from_step)) if from_step else None)
    return attempt, time.time()


def _train(rd: RunDir, steps: range, kept: float, t_start: float, every: int = 10, step_s: float = 0.01) -> float:
    """Steps in real time; a checkpoint at every ``every``; returns the productive time kept so far."""
    productive = kept
    for step in steps:
        time.sleep(step_s)
        if step % every == 0:
            productive = kept + time.time() - t_start
            ckpt(rd, step, productive, 4)
        progress(rd, step)
    return productive


def _exit(rd: RunDir, job: str, attempt: int, outcome: str, code: int, cause: str | None,
          bad: list[str] | None = None, signal: str = "none") -> None:
    """The batch script's exit hook's records (runner.host.jobhook.on_exit)."""
    atomic_write(rd.exit_status, json.dumps({"exit_code": code, "job_id": job, "attempt": attempt, "signal": signal,
                                             "event": outcome, "time": time.time()}) + "\n")
    rd.record("exit", job_id=job, exit_code=code, signal=signal, outcome=outcome, attempt=attempt, cause=cause,
              crash=None, nodes=bad or [])


def fault_run(root: Path, webhook_url: str | None = None) -> RunDir:
    """Preempted at step 40 (checkpointed, requeued), rank 3 killed at step 67 (resubmitted by cron, 7 steps lost),
    a hang at step 85 on n2 (n2 kept out, resubmitted, 5 steps lost), a NaN skipped at step 93, finished at 100."""
    over = ["trainer.max_steps=100", "alerts.enabled=true", "alerts.kind=json"]
    rd = plan_run(root, "slurm-2node.yaml", *over)
    cfg = read_resolved(rd.config)
    saved_url = os.environ.get("RUNNER_WEBHOOK_URL")
    if webhook_url:
        os.environ["RUNNER_WEBHOOK_URL"] = webhook_url
    try:
        return _fault_run(rd, cfg)
    finally:
        if webhook_url:
            if saved_url is None:
                os.environ.pop("RUNNER_WEBHOOK_URL", None)
            else:
                os.environ["RUNNER_WEBHOOK_URL"] = saved_url


def _fault_run(rd: RunDir, cfg: Any) -> RunDir:
    def alert(event: str, job: str, attempt: int, **fields: Any) -> None:
        alerts.notify(rd.root, cfg["alerts"], event, job_id=job, attempt=attempt, **fields)

    atomic_write(rd.job_id_file, "101\n")
    rd.record("submitted", scheduler="slurm", job_id="101", world_size=4)
    # 1: preempted at step 40 (the signal's checkpoint), requeued by the exit hook
    a, t = _attempt(rd, "101", "n[1-2]", ["n1", "n2"], 0, 0.3, 0, 0)
    kept = _train(rd, range(1, 41), 0.0, t)
    _exit(rd, "101", 1, "preempted", 75, None, signal="USR2")
    rd.record("requeued", job_id="101", reason="preempted", attempt=2)
    alert("preempted", "101", 1, exit_code=75, next_step="requeued; it resumes from step 40")
    # 2: rank 3 killed at step 67; cron resubmits after its backoff
    a, t = _attempt(rd, "101", "n[1-2]", ["n1", "n2"], 1, 0.3, 40, 0)
    kept = _train(rd, range(41, 68), kept, t)
    for r, host in enumerate(["n1", "n1", "n2", "n2"]):
        heartbeat(rd, r, host, 67, a, 0.004, 0.001)
    killed = "srun: error: n2: task 3: Killed (rank 3, signal 9)"
    _exit(rd, "101", 2, "failed", 137, killed)
    alert("failed", "101", 2, exit_code=137, cause=killed, next_step="runner cron resubmits it")
    time.sleep(0.2)  # cron's backoff
    atomic_write(rd.job_id_file, "102\n")
    rd.record("resubmitted", job_id="102", reason="failed: rank 3 killed", attempt=3, by="cron")
    alert("resubmitted", "102", 3, next_step="resubmitted as job 102")
    # 3: rank 2 on n2 stops in its data loader at step 85: the watchdog fires, n2 is kept out
    a, t = _attempt(rd, "102", "n[1-2]", ["n1", "n2"], 0, 0.25, 60, 7)
    kept = _train(rd, range(61, 86), kept, t)
    time.sleep(0.3)  # the stall until the watchdog's limit
    reports = {r: {"rank": r, "host": h, "step": 85, "phase": "data" if r == 2 else "collective",
                   "where": "train.py:__getitem__" if r == 2 else None, "stalled_s": 0.3}
               for r, h in enumerate(["n1", "n1", "n2", "n2"])}
    for r, rep in reports.items():
        atomic_write(rd.root / "hangs" / f"attempt-{a}" / f"rank-{r:05d}.json", json.dumps(rep))
    summary = watchdog.summarize(reports, 4, {r: rep["host"] for r, rep in reports.items()})
    summary.update(step=85, attempt=a, time=time.time(), world=4)
    atomic_write(rd.root / "hang.json", json.dumps(summary, indent=1))
    rd.record("hang", summary=summary["summary"], nodes=summary["nodes"], step=85)
    _exit(rd, "102", 3, "hang", 79, summary["summary"], bad=["n2"])
    nodes.record(rd.root.parent, ["n2"], "hang", rd.name, summary["summary"])
    alert("hang", "102", 3, exit_code=79, cause=summary["summary"], next_step="resubmitted without n2")
    atomic_write(rd.job_id_file, "103\n")
    rd.record("resubmitted", job_id="103", reason="hang: n2 kept out", attempt=4, by="cron")
    # 4: on n1 and n3; a NaN at step 93 is skipped (nonfinite.action=skip); finished at 100
    a, t = _attempt(rd, "103", "n[1,3]", ["n1", "n3"], 0, 0.2, 80, 5)
    kept = _train(rd, range(81, 93), kept, t)
    rd.record("nonfinite_skipped", step=93, what="loss nan")  # as runner.job.guards words it
    kept = _train(rd, range(93, 101), kept, t)
    for r, host in enumerate(["n1", "n1", "n3", "n3"]):
        heartbeat(rd, r, host, 100, a, 0.004 if r != 2 else 0.011, 0.001 if r != 2 else 0.02)
    productive = kept + 0.0
    atomic_write(rd.finished, json.dumps({"step": 100, "time": time.time(), "productive_s": productive}) + "\n")
    rd.record("finished", step=100)
    _exit(rd, "103", 4, "completed", 0, None)
    alert("completed", "103", 4, exit_code=0, next_step="Nothing: training finished.")
    return rd


def clean_run(root: Path) -> RunDir:
    """A local quickstart run that trained 60 steps: submitted, preflight, first step, 6 checkpoints, finished."""
    rd = plan_run(root, "quickstart.yaml")
    rd.record("submitted", scheduler="local", world_size=2)
    attempt = rd.new_attempt()
    preflight(rd, ["laptop"], 0.1)
    time.sleep(0.1)
    rd.record("train_start", step=0, lost_steps=0, attempt=attempt, resumed_from=None)
    t = time.time()
    kept = _train(rd, range(1, 61), 0.0, t, step_s=0.005)
    for r in range(2):
        heartbeat(rd, r, "laptop", 60, attempt, 0.002, 0.0005)
    atomic_write(rd.finished, json.dumps({"step": 60, "time": time.time(), "productive_s": kept}) + "\n")
    rd.record("finished", step=60)
    rd.record("exit", exit_code=0)
    return rd


def _line(t: float, event: str, **fields: Any) -> str:
    """A ledger line exactly as RunDir.record writes it, at time ``t``."""
    return json.dumps({"time": round(t, 3), "event": event, **fields}, sort_keys=True) + "\n"


def thirty_day_run(root: Path, checkpoints: int = 10_000, attempts: int = 200, ranks: int = 64) -> RunDir:
    """30 days of a 64-rank run: ``attempts`` attempts (preemptions, failures, hangs) and ``checkpoints``
    complete checkpoints on disk (checkpoint.keep_last large), 64 heartbeats, a preflight of 8 nodes."""
    rd = plan_run(root, "slurm-2node.yaml", "num_nodes=8", "num_device=8", "global_batch_size=512",
                  "checkpoint.keep_last=100000", "trainer.max_steps=1000000",
                  "dataloader.train.total_shards=64", "dataloader.valid.total_shards=64")
    t0 = json.loads(rd.manifest.read_text())["created"] - 30 * 86400
    manifest = json.loads(rd.manifest.read_text())
    manifest["created"] = t0
    rd.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    span = 30 * 86400 / attempts
    per = checkpoints // attempts
    every = 100
    step_s = (span - 900) / (per * every)  # back to back: each attempt trains until its next one is queued
    lines = [_line(t0, "submitted", scheduler="slurm", job_id="5000", world_size=ranks)]
    hosts = [f"gpu{n:03d}" for n in range(ranks // 8)]
    step, kept = 0, 0.0
    outcomes = ["preempted", "timeout", "failed", "hang", "preempted"]
    for a in range(1, attempts + 1):
        q = t0 + (a - 1) * span
        job = str(5000 + a)
        start = q + 600
        lines.append(_line(start, "start", job_id=job, nodes="gpu[000-007]", restart_count=0))
        lines.append(_line(start + 30, "preflight", status="pass", duration_s=30.0, summary="preflight passed"))
        lost = 0 if a == 1 or outcomes[(a - 2) % 5] in ("preempted", "timeout") else 40
        train = start + 120
        lines.append(_line(train, "train_start", step=step, lost_steps=lost, attempt=a, resumed_from=None))
        for c in range(per):
            step += every
            when = train + (c + 1) * every * step_s
            kept += every * step_s
            d = rd.checkpoints / f"step-{step:07d}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_text(json.dumps({"step": step, "time": when, "productive_s": round(kept, 3),
                                                         "config_hash": manifest["config_hash"]}))
            checkpoint.CheckpointDir.marker(d).write_text(f"{step}\n")
        if a % 17 == 0:
            lines.append(_line(train + 100, "nonfinite_skipped", step=step - 50, what="loss inf"))
        if a % 23 == 0:
            lines.append(_line(train + 200, "straggler", rank=a % ranks, node=hosts[a % len(hosts)], slow="data",
                               step=step, compute_x=1.0, data_x=3.2, compute_s=0.2, data_s=0.3, attempt=a))
        end = train + per * every * step_s + 60
        outcome = "completed" if a == attempts else outcomes[(a - 1) % 5]
        if outcome == "hang":
            lines.append(_line(end - 30, "hang", summary=f"hang: 63 of 64 ranks in collective; rank 5 on "
                                                         f"{hosts[0]} (in data)", nodes=[hosts[0]], step=step))
        if a == attempts:
            lines.append(_line(end - 1, "finished", step=step))
        lines.append(_line(end, "exit", job_id=job, exit_code=0 if a == attempts else 75, signal="none",
                           outcome=outcome, attempt=a, cause=None if outcome in ("preempted", "timeout", "completed")
                           else f"{outcome}: attempt {a}", crash=None, nodes=[]))
        if a < attempts:
            lines.append(_line(end + 5, "requeued" if outcome in ("preempted", "timeout") else "resubmitted",
                               job_id=job, reason=outcome, attempt=a + 1))
    rd.ledger.write_text("".join(lines))
    preflight(rd, hosts, 0.0, record=False)  # the last attempt's report (its ledger line is above)
    atomic_write(rd.finished, json.dumps({"step": step, "time": t0 + 30 * 86400, "productive_s": kept}) + "\n")
    atomic_write(rd.root / "progress.json", json.dumps({"step": step, "time": t0 + 30 * 86400}) + "\n")
    for r in range(ranks):
        atomic_write(rd.root / "heartbeats" / f"rank-{r:05d}.json",
                     json.dumps({"rank": r, "host": hosts[r // 8], "pid": r, "step": step, "time": t0,
                                 "attempt": attempts, "step_s": step_s, "compute_s": 0.2 + 0.001 * r,
                                 "data_s": 0.01 if r != 9 else 0.05}))
    return rd


def restless_run(root: Path, attempts: int = 50_000, checkpoints: int = 5_000) -> RunDir:
    """A run that restarted ``attempts`` times, of every kind in turn: preempted, a failed preflight (no step; a
    person resumed it), a hang, a crash (steps lost), a time limit, a NaN (a person resumed it); the node a failed
    preflight, a hang or a crash named is remembered in the root's nodes.jsonl; a resize every 100 attempts;
    ``checkpoints`` complete checkpoints spread over the attempts that trained. The shape that made ``runner report``
    quadratic (issue 39): attempts that never trained, node memory growing with the faults."""
    rd = plan_run(root, "slurm-2node.yaml", "checkpoint.keep_last=100000", "trainer.max_steps=100000000")
    manifest = json.loads(rd.manifest.read_text())
    t0 = manifest["created"] - 30 * 86400
    manifest["created"] = t0
    rd.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    span = 30 * 86400 / attempts
    ckpt_every = max(attempts // max(checkpoints, 1), 1)
    kinds = ["preempted", "preflight_failed", "hang", "failed", "timeout", "nan"]
    lines = [_line(t0, "submitted", scheduler="slurm", job_id="9000", world_size=4)]
    bad = []
    step, kept, lost, written = 0, 0.0, 0, 0
    for a in range(1, attempts + 1):
        q, job = t0 + (a - 1) * span, str(9000 + a)
        kind = "completed" if a == attempts else kinds[(a - 1) % len(kinds)]
        start = q + span * 0.1
        lines.append(_line(start, "start", job_id=job, nodes="n[1-2]", restart_count=0, attempt=a))
        if a % 100 == 0:
            lines.append(_line(start + 1, "resized", change="2 x 2 -> 2 x 2", world_size=4, accumulate=1))
        pre = start + span * 0.1
        lines.append(_line(pre, "preflight", status="fail" if kind == "preflight_failed" else "pass",
                           duration_s=round(span * 0.05, 3), summary="preflight"))
        end = q + span * 0.9
        if kind != "preflight_failed":
            train = pre + span * 0.05
            lines.append(_line(train, "train_start", step=step, lost_steps=lost, attempt=a, resumed_from=None))
            step += 100
            kept += end - train
            if a % ckpt_every == 0 and written < checkpoints:
                d = rd.checkpoints / f"step-{step:09d}"
                d.mkdir(parents=True)
                (d / "manifest.json").write_text(json.dumps({"step": step, "time": end - 1.0,
                                                             "productive_s": round(kept, 3),
                                                             "config_hash": manifest["config_hash"]}))
                checkpoint.CheckpointDir.marker(d).write_text(f"{step}\n")
                written += 1
        lost = 40 if kind in ("hang", "failed", "nan") else 0
        node = {"preflight_failed": "n1", "hang": "n2", "failed": "n3"}.get(kind)
        if node:
            bad.append(json.dumps({"node": node, "cause": kind, "run": rd.name, "detail": "", "time": end}) + "\n")
        if kind == "hang":
            lines.append(_line(end - 2, "hang", summary="hang: rank 3 on n2 (in data)", nodes=["n2"], step=step))
        if kind == "nan":
            lines.append(_line(end - 2, "nonfinite", step=step, what="loss nan", skipped_in_a_row=1))
        if kind == "completed":
            lines.append(_line(end - 1, "finished", step=step))
        lines.append(_line(end, "exit", job_id=job, exit_code=0 if kind == "completed" else 1, signal="none",
                           outcome=kind, attempt=a, cause=None if kind in ("preempted", "timeout", "completed")
                           else f"{kind}: attempt {a}", crash=None, nodes=[node] if node else []))
        if kind in ("preempted", "timeout"):
            lines.append(_line(end + 1, "requeued", job_id=job, reason=kind, attempt=a + 1))
        elif kind != "completed":
            by = "user" if kind in ("preflight_failed", "nan") else "cron"
            lines.append(_line(end + 1, "resubmitted", job_id=str(9001 + a), reason=kind, attempt=a + 1, by=by))
    rd.ledger.write_text("".join(lines))
    nodes.path(root).write_text("".join(bad))
    atomic_write(rd.finished, json.dumps({"step": step, "time": t0 + 30 * 86400, "productive_s": kept}) + "\n")
    atomic_write(rd.root / "progress.json", json.dumps({"step": step, "time": t0 + 30 * 86400}) + "\n")
    return rd
