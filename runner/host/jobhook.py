"""Host-side hooks the batch script calls, so that the script itself only traps signals and calls: ``begin`` before
any rank starts (this job's claim on the run, the attempt's number and variables, the image's signature), ``start``
when the step starts, ``signal`` when the stop signal comes, ``exit`` when the step has ended; ``reap`` beside a step
with spares (a lost node ends the step before Slurm marks it down).

They run with the login node's runner on the first node of the allocation, never in the container
(``scontrol`` is usually missing there). ``exit`` gathers the facts (the launcher's exit code, the run's
records, the job's time left), asks ``runner.policy`` what they mean and what to do, and requeues the job
first: Slurm ends the batch script soon after it accepts a requeue, and the job may be seconds from its time
limit. Then it records (``requeued`` only once ``scontrol requeue`` succeeded; the record itself is
``runner.host.ending``'s, shared with local runs), and queues its alerts on disk for a detached sender
(``runner.alerts.background``): no webhook ever stands in front of the requeue. The rank logs are read once for
the cause and the log tail. Its output lands in Slurm's batch log, with timestamps.

With a successor queued behind the job (``runner.host.successor``), ``exit`` hands over to it instead of
requeueing, or cancels it before this job ends (so it never starts) when the run finished, stopped, gave up or
is resubmitted. ``claim`` (in ``begin``) is the successor's side: it takes the run over (``job_id``) and queues its
own successor, or steps aside (exit 78) when ``runner.policy.take_over`` says the run is not its to train.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner import ledger, policy, proc, slurmstates, world
from runner import log as runner_log
from runner.alerts import causes, nextstep
from runner.errors import RunnerError
from runner.host import ending, nodes, notices, observe, scheduler, slurm, successor
from runner.records import RunManifest
from runner.rundir import (
    ATTEMPT_ENV,
    EXIT_PREFLIGHT,
    EXIT_SUPERSEDED,
    HEARTBEAT_S,
    SUCCESSOR_ENV,
    RunDir,
    Standby,
    atomic_write,
    read_json,
)
from runner.spec.typed import read_resolved

ALERT_BUDGET_S = 15.0  # the background sender's time; what it cannot send stays queued for runner cron
log = logging.getLogger("runner.host.jobhook")  # not __name__: run with -m, this module is __main__


def launcher_code(run: RunDir, rc: int, job: str | None) -> int:
    """The exit code the ranks agreed on, if rank 0 recorded one for this attempt; else srun's."""
    last = run.last_exit_record()
    same = last is not None and last["job_id"] == job and \
        last["restart_count"] == os.environ.get("SLURM_RESTART_COUNT", "0")
    return last["code"] if last is not None and same else rc


def _alerts(run: RunDir, event: ledger.AlertEvent, decision: policy.Decision, requeued: bool | None,
            **fields: Any) -> list[Any]:
    """The alerts of this exit, in order, from one read of the rank logs (the first one carries the cause)."""
    from runner import alerts

    base = alerts.alert_from_run(run.root, event, **fields)
    out = [base]
    if requeued:
        out.append(dataclasses.replace(base, event="requeued", cause=None, cause_kind=None))
    elif decision.action == "give_up":
        out.append(dataclasses.replace(base, event="gave_up"))
    return out


def _batch_output(run: RunDir, job: str | None, rec: policy.Records) -> list[str]:
    """This attempt's part of Slurm's batch output (srun's ``srun: error: n2: task 3: Killed`` lines): from where the
    file ended when the start hook ran (``--open-mode=append`` keeps every attempt's output in one file)."""
    if not job:
        return []
    starts = [e for e in rec.events if e["event"] == "start" and e.get("job_id") == job]
    start: Mapping[str, Any] = starts[-1] if starts else {}
    found = start.get("out_offset")
    offset = found if isinstance(found, int) else 0
    try:
        with open(run.batch_log(job), "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - 256 * 1024))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _ran_on() -> list[str]:
    """The nodes this step trained on (``world.STEP_NODES_ENV``, set with slurm.spare_nodes); [] when not set."""
    return [n for n in os.environ.get(world.STEP_NODES_ENV, "").split(",") if n]


def step_nodes(cfg: Any, events: list[Any], job: str | None, outcome: str, named: list[str], down: list[str]) \
        -> tuple[list[str], tuple[str, ...] | None]:
    """resume.in_job: the nodes this end names bad (``named``, and ``down``, the job's nodes Slurm reports down), and
    those the next step of this job would train on (``policy.step_nodes``: without every node named bad in this job
    so far, unless none is left but a hang's node, ``policy.doubtful_nodes``; None when too few are left)."""
    allocation = slurm.hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    previous = _ran_on() or allocation
    bad = sorted(set(named) | set(down))
    ends = [*policy.in_job_ends(events, job), (outcome, bad)]
    earlier = {n for _, nodes in ends for n in nodes}
    return bad, policy.step_nodes(allocation, previous, earlier, cfg["num_nodes"], policy.doubtful_nodes(ends, down))


def on_exit(run: RunDir, rc: int, signal_name: str, again: bool = False) -> int:
    """Decide, requeue first (Slurm may end the job any second), then record, then queue the alerts. ``again``: the
    batch script's loop asks (resume.in_job); ``world.AGAIN`` tells it to train again in this job."""
    from runner import alerts
    from runner.alerts import background

    job = slurmstates.job_id(os.environ)
    seen = observe.look(run, _has_successor, job=job)  # Slurm is asked about the successor once it matters
    cfg = seen.config
    limits = policy.Limits.of(cfg)
    rc = launcher_code(run, rc, job)
    rec = seen.records
    attempt = policy.attempt(rec.events)
    # The time left tells a time limit from a preemption.
    got = getattr(signal, f"SIG{signal_name}", None) if signal_name not in ("none", "TERM") else None
    asked = signal_name != "none"  # a stop the job was sent, not srun's SIGTERM to the ranks a failed one left
    left = slurm.time_left(job) if job and policy.stopped_by(rc, got, asked) else None
    event = policy.classify(rec, rc, left, limits, job, got, asked)
    if event == "superseded":  # another job owns the run: its records and alerts are not this job's to write
        run.record("superseded", job_id=job, owner=rec.job_id, exit_code=rc)
        log.info("job %s was superseded by job %s: no checkpoint written, nothing else recorded", job, rec.job_id)
        return 0
    number = os.environ.get(ATTEMPT_ENV, "")
    logs = int(number) if number.isdigit() else (run.attempts() or [0])[-1]  # the attempt's log folder
    probe_only = cfg["preflight"].get("only") is True  # `runner preflight`: a report, never a resubmission
    restartable = again and limits.in_job and event in policy.IN_JOB and not probe_only
    reaped = _reaped([*rec.events], job, logs) if restartable else []
    down = sorted(set(slurm.unhealthy(os.environ.get("SLURM_JOB_NODELIST", ""))) | set(reaped)) if restartable else []
    ran_on = _ran_on()
    why = ending.why(run, event, logs, rec.events, causes.srun_exits(_batch_output(run, job, rec)), notice=signal_name,
                     lost=[n for n in down if n in ran_on], reaped=reaped)
    crash, bad = why.crash, why.bad
    this_exit = {"event": "exit", "outcome": event, "crash": crash, "time": time.time()}
    heir = _successor(observe.answer(seen, using=slurm.squeue_many))
    in_job = None
    if restartable:
        bad, in_job = step_nodes(cfg, [*rec.events], job, event, bad, down)
    down = [n for n in down if n not in why.bad]
    decision = policy.after_exit(event, attempt, job, limits, [*rec.events, this_exit], () if probe_only else bad,
                                 heir, in_job)
    if heir and decision.action not in ("hand_over", "restart"):  # before this job ends: else Slurm would start it
        successor.cancel(run, heir, f"{event}: {decision.reason}")
    elif heir and decision.delay_s:
        if (complaint := slurm.delay_start(heir, decision.delay_s)) is not None:
            log.warning("successor job %s starts without its %.0f s backoff: %s", heir, decision.delay_s, complaint)
    if decision.action == "stop" and crash:
        why = dataclasses.replace(why, cause=causes.crashed(crash, "crash_loop"))
    if why.bad:
        nodes.record(run.root.parent, why.bad, "preflight" if event == "preflight_failed" else event, run.name,
                     why.sentence or "")
    for lost, said in ((set(down) - set(reaped), "Slurm reports it down"), (set(down) & set(reaped), "silent")):
        if lost:  # in-job: the nodes of the job Slurm reports down, or the step reaper found lost
            nodes.record(run.root.parent, sorted(lost), "node_fail", run.name, f"{said} after {event}")
    requeued, refusal = None, None
    if decision.action == "requeue" and job:
        # Slurm ends the job (SIGTERM, then SIGKILL after KillWait) once it accepts the requeue: finish the records.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        refusal = slurm.requeue(job)
        requeued = refusal is None
    step = nextstep.next_step(event, decision, attempt, limits, requeued, [*rec.events, this_exit])
    where = os.environ.get(world.STEP_NODES_ENV) or os.environ.get("SLURM_JOB_NODELIST", "")
    common = {"job_id": job or "", "attempt": attempt, "nodes": where,
              "exit_code": rc, "next_step": step, **ending.alert_fields(run, why, logs)}
    queued = _alerts(run, event, decision, requeued, **common) if event != "cancelled" and \
        ledger.is_alert_event(event) else []
    secrets = alerts.secrets_of(cfg["alerts"])
    ending.record(run, cfg["alerts"], {"job_id": job, "exit_code": rc, "signal": signal_name, "outcome": event,
                                       "attempt": attempt, "cause": queued[0].cause if queued else None,
                                       "crash": crash, "nodes": bad})
    if decision.action == "restart":
        run.record("restarted", job_id=job, reason=event, attempt=attempt + 1, nodes=list(decision.nodes), bad=bad)
    elif decision.action == "hand_over":
        run.record("handed_over", job_id=job, successor=heir, reason=event, attempt=attempt + 1,
                   delay_s=decision.delay_s)
    elif requeued:
        run.record("requeued", job_id=job, reason=event, attempt=attempt + 1)
    elif requeued is False:
        run.record("requeue_failed", job_id=job, reason=event, error=alerts.redact(refusal or "", secrets))
        log.warning("scontrol requeue %s: %s; runner cron will resubmit the run", job, refusal)
    elif decision.action == "give_up":
        run.record("gave_up", job_id=job, reason=decision.reason)
    elif decision.action == "stop":
        run.record("stopped", job_id=job, reason=decision.reason)
    elif decision.action == "resubmit":  # without the nodes it named; the new job owns the run from now on
        try:
            scheduler.SLURM.resubmit(run, cfg, decision.reason)
        except RunnerError as e:
            log.warning("resubmission failed: %s; runner cron tries again", e)
    log.info("exit %s: %s: %s; next: %s", rc, event, decision.reason, step)
    noticed = notices.queue_stragglers(run, cfg, job)  # what the job recorded while it ran comes first
    sender = background.send_later(run.root, ALERT_BUDGET_S) \
        if alerts.enqueue(run.root, cfg["alerts"], queued) + noticed else None
    if sender is not None:  # the job's leftover processes die with the batch script: give the sender its time
        with contextlib.suppress(subprocess.TimeoutExpired):
            sender.wait(timeout=ALERT_BUDGET_S + 5)
    return world.AGAIN if decision.action == "restart" else 0


def _has_successor(rec: policy.Records, manifest: RunManifest) -> bool:
    return rec.successor is not None


def _successor(seen: observe.Observation) -> str | None:
    """The successor queued behind this job, if Slurm still holds it (else the run recovers as without one): the
    controller's live view (``squeue``), which knows a job in the queue at once."""
    info = seen.heir
    return seen.records.successor if info is not None and not info.terminal else None


def claim(run: RunDir) -> int:
    """A successor job, before its ranks start: take the run over (0) or step aside (``EXIT_SUPERSEDED``)."""
    job, after = slurmstates.job_id(os.environ) or "", os.environ.get(SUCCESSOR_ENV, "")
    cfg = read_resolved(run.config)
    rec = observe.records(run)
    decision = policy.take_over(rec, job, after, policy.Limits.of(cfg))
    if decision.action != "train":
        log.info("successor job %s steps aside: %s", job, decision.reason)
        return EXIT_SUPERSEDED
    if rec.job_id != job:
        atomic_write(run.job_id_file, job + "\n")  # the owner from now on: the ranks check it while training
        run.record("took_over", job_id=job, after=after, reason=decision.reason)
    if successor.following(run, job) is None:
        successor.queue(run, cfg, job)
    log.info("%s", decision.reason)
    return 0


def verify(run: RunDir, key: str) -> int:
    """``container.verify_key``: Apptainer verifies the run's SIF against the public key before any rank starts; one
    that does not verify is refused (``EXIT_PREFLIGHT``) with the reason in preflight.json, as a stale image is."""
    cfg = read_resolved(run.config)
    image = (run.manifest_record() or {}).get("image") or ""
    tool = cfg["container"]["runtime"]
    out = proc.run([tool, "verify", "--key", key, image], timeout=300, check=False)  # 127 missing, 124 timed out
    rc, said = out.returncode, out.stdout + out.stderr
    if rc == 0:
        log.info("image %s: its signature verifies with %s", image, key)
        return 0
    why = [line.split(":", 1)[-1].strip() for line in said.splitlines() if line.strip()][-1:] or [f"exit {rc}"]
    summary = f"image signature: {image} does not verify with {key} ({why[0]})"
    hint = "hint: rebuild and sign it (runner build with container.sign_key), or check container.verify_key"
    log.error("%s. %s", summary, hint)
    atomic_write(run.preflight, json.dumps({"status": "fail", "summary": summary}) + "\n")
    atomic_write(run.preflight_table, f"{summary}. {hint}\n")
    return EXIT_PREFLIGHT


def begin(run: RunDir, key: str, needed: int = 0, events: list[Any] | None = None) -> tuple[int, dict[str, str]]:
    """Before any rank starts: whether this job trains the run, and the environment of the attempt it trains.

    In order: a job older than the run's owner (``job_id``: Slurm requeued it after ``runner cron`` had resubmitted
    the run) steps aside with ``EXIT_SUPERSEDED``, as does a successor the run is not for (``claim``); the attempt
    is claimed (its number, as a local run claims one); the image's signature is checked (``container.verify_key``,
    ``EXIT_PREFLIGHT``). The attempt's step trains on ``needed`` nodes of the job (0: all; ``step_of``). Returns
    the exit code (0: train) and the variables for the batch script to export (the attempt's, ``runner.world``),
    which it gets even when the image is refused, so that the exit hook records the attempt. ``events``: the ledger,
    where the caller read it already."""
    job = slurmstates.job_id(os.environ) or ""
    owner = run.job_id() or ""
    mine, theirs = slurmstates.submitted_at(job), slurmstates.submitted_at(owner)
    if mine is not None and theirs is not None and theirs > mine:
        log.warning("job %s was superseded by job %s; exiting without training", job, owner)
        return EXIT_SUPERSEDED, {}
    if os.environ.get(SUCCESSOR_ENV) and claim(run) != 0:
        return EXIT_SUPERSEDED, {}
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    allocation = slurm.hostnames(nodelist)
    number = os.environ.get("SLURM_JOB_ID", "")  # this job's own number (an array task's too): its ports
    if not allocation or not number.isdigit():
        log.error("cannot read the first node of SLURM_JOB_NODELIST=%r (job %r): no rendezvous for the ranks",
                  nodelist, number)
        return 1, {}
    on, restart = step_of(run.events() if events is None else events, job, allocation, needed or len(allocation))
    try:
        attempt = run.new_attempt(make_logs=False)
        if restart:  # the code rank 0 left for the previous attempt of this very job is not this attempt's
            run.last_exit.unlink(missing_ok=True)
    except OSError as e:
        log.error("cannot create %s", e.filename)
        return 1, {}
    env = world.attempt_env(run.root, attempt, world.Rendezvous.of_job(on[0], int(number), restart))
    env[world.STEP_NODES_ENV] = ",".join(on)
    return (verify(run, key) if key else 0), env


def warm_standby(events: list[Any], code: int, env: Mapping[str, str], folder: str, per_node: int) \
        -> dict[str, str]:
    """resume.in_job's warm standby, after ``begin`` (``events``: the ledger it read): hand this attempt to the
    standby step in ``folder`` (the one started beside the last attempt; "" when none lives) where
    ``policy.standby_takes``, else stand it down; and the nodes the next standby step waits on (``policy.gone_nodes``
    left out). Returns the batch script's variables: ``warm`` ("1": the standby is this attempt's step),
    ``standby_nodes``, ``standby_count``, ``standby_tasks``."""
    job = slurmstates.job_id(os.environ)
    gone = policy.gone_nodes(policy.in_job_ends(events, job))
    chosen = [n for n in env.get(world.STEP_NODES_ENV, "").split(",") if n]
    took = False
    if folder:
        standby = Standby(Path(folder))
        took = code == 0 and policy.standby_takes(standby.present(), chosen, per_node)
        standby.hand_off({"env": dict(env), "nodes": chosen if took else [], "per_node": per_node})
        log.info("attempt %s: %s", env.get(ATTEMPT_ENV, "?"), "the warm standby step trains it" if took else
                 "a new step (the warm standby step stood down: not every slot of its nodes waits)")
    nodes = [n for n in slurm.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) if n not in gone]
    return {"warm": "1" if took else "", "standby_nodes": ",".join(nodes), "standby_count": str(len(nodes)),
            "standby_tasks": str(len(nodes) * per_node)}


def stand_down(folder: str) -> None:
    """The job trains no more: the warm standby step's tasks exit 0 (Slurm would kill them as the job ends)."""
    if folder:
        Standby(Path(folder)).hand_off({"env": {}, "nodes": [], "per_node": 1})


def step_of(events: list[Any], job: str, allocation: list[str], needed: int) -> tuple[list[str], int]:
    """The nodes of this attempt's step and how many in-job restarts came before it: the exit hook's choice when it
    restarted the training in this job (its last word since the job's last start), else the job's first
    ``needed`` nodes (its spares after them: slurm.spare_nodes), as after a requeue by Slurm (new nodes, maybe)."""
    restarts = [e for e in events if e["event"] == "restarted" and e.get("job_id") == job]
    last = next((e for e in reversed(events) if e["event"] in ("start", "restarted") and e.get("job_id") == job), None)
    chosen = last.get("nodes") if last is not None and last["event"] == "restarted" else None
    if chosen and set(chosen) <= set(allocation):
        return [str(n) for n in chosen], len(restarts)
    return allocation[:needed], len(restarts)


def deliver(run: RunDir, signame: str, step: int, ranks: int) -> int:
    """The stop signal for this attempt's ranks (the handshake: ``runner.rundir``): written down first, then sent to
    the job step (srun forwards it to every rank) once every rank said its handlers are in place, so that none dies
    of it. Before the step has started (``step`` 0) it is only written down: each rank reads it when ready."""
    attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    run.announce_signal(attempt, signame)
    ready = [run.ready_file(attempt, r) for r in range(ranks)]
    while step > 0 and not all(p.exists() for p in ready):
        try:
            os.kill(step, 0)
        except ProcessLookupError:  # the step ended first: nothing left to signal
            return 0
        time.sleep(0.2)
    if step > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(step, getattr(signal, f"SIG{signame}"))
    return 0


SILENT_S = 3 * HEARTBEAT_S  # a rank that beat nothing for this long after its peers failed is on a lost node
SILENT_DOWN_S = 2 * HEARTBEAT_S  # ... or, with no peer failed, for this long while its node's slurmd refuses


def _fs_now(folder: Path) -> float:
    """Now by the clock that stamps the files in ``folder`` (a shared file system's server's, not this host's): the
    heartbeats' mtimes are measured against it, so no clock skew between nodes can make a rank look silent."""
    probe = folder / ".reaper-clock"
    probe.touch()
    return probe.stat().st_mtime


def _quiet(run: RunDir, attempt: int, only_over: float = 0.0) -> dict[int, float]:
    """Each rank's silence: how long its heartbeat of ``attempt`` has not changed, by its file's age. A beat is read
    (its attempt checked) only where the file is older than ``only_over``: younger ones are not silent anyway."""
    now = _fs_now(run.heartbeats)
    quiet: dict[int, float] = {}
    for rank, path in RunDir.by_rank(run.heartbeats).items():
        with contextlib.suppress(FileNotFoundError):  # a newer beat's mtime: younger, never falsely silent
            age = now - path.stat().st_mtime
            if age < only_over:
                quiet[rank] = age
                continue
            beat = read_json(path)
            if isinstance(beat, dict) and beat.get("attempt") == attempt:
                quiet[rank] = now - path.stat().st_mtime  # again: it may have beaten while read
    return quiet


def reap(run: RunDir, step: int, world_size: int, every: float = 0.5) -> int:
    """resume.in_job with slurm.spare_nodes: end a step that waits on a lost node before Slurm says it is down.

    A node lost with its ranks (power, kernel panic, its slurmd gone) leaves srun waiting for slurmctld to mark it
    down (SlurmdTimeout and its ping cycle, 20 s and more). Here, on the batch host, once a rank said it ended with a
    failure (``exits/rank-*.json``), every rank's heartbeat is watched; when ``policy.lost_nodes`` names nodes whose
    ranks all went silent, the reaper records ``nodes_lost`` and ends srun (SIGKILL); the exit hook names those nodes
    bad and the next step trains without them (``--overlap`` beside the remains Slurm cleans up later). A node none of
    whose peers fails (a step on that one node) is named where every rank of it is silent (``policy.silent_nodes``)
    for two beats and its slurmd refuses a connection (``slurm.slurmd_answers``: a hang's node still answers; a
    slurmd restarted by an admin leaves its ranks beating). A rank's silence is its heartbeat file's age
    (``_fs_now``), so the beats a lost node missed before its peers failed count too. While
    no rank ended it looks at the heartbeats' ages once a heartbeat interval, reading only those that are old."""
    attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    hosts: dict[int, str] = {}
    next_look = time.monotonic() + HEARTBEAT_S
    while True:
        time.sleep(every)
        try:
            os.kill(step, 0)
        except ProcessLookupError:  # the step ended as steps do
            return 0
        ended = run.rank_exits(attempt)
        if not run.heartbeats.is_dir() or (not ended and time.monotonic() < next_look):
            continue
        next_look = time.monotonic() + HEARTBEAT_S
        hosts = hosts if len(hosts) >= world_size else run.rank_hosts(attempt)
        if ended:
            quiet = _quiet(run, attempt)
            lost = policy.lost_nodes(hosts, ended, quiet, world_size, SILENT_S)
            how = "after {} peers failed"
        else:
            quiet = _quiet(run, attempt, SILENT_DOWN_S)
            lost = tuple(n for n in policy.silent_nodes(hosts, quiet, world_size, SILENT_DOWN_S)
                         if slurm.slurmd_answers(n) is False)
            how = "and {} slurmd refuses a connection"
        if lost:
            silent = min(q for r, q in quiet.items() if r not in ended and hosts.get(r) in lost)
            run.record("nodes_lost", job_id=slurmstates.job_id(os.environ), attempt=attempt, nodes=list(lost),
                       silent_s=round(silent, 1))
            one = len(lost) == 1
            log.warning("%s lost: no heartbeat for %.0f s %s; ending the step before Slurm marks %s down",
                        ", ".join(lost), silent, how.format("its" if one else "their"), "it" if one else "them")
            with contextlib.suppress(ProcessLookupError):
                os.kill(step, signal.SIGKILL)
            return 0


def _reaped(events: list[Any], job: str | None, attempt: int) -> list[str]:
    """The nodes the step reaper found lost in this attempt of this job."""
    return sorted({n for e in events if e["event"] == "nodes_lost" and e.get("job_id") == job
                   and e.get("attempt") == attempt for n in e.get("nodes", ())})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.host.jobhook")
    parser.add_argument("what", choices=("begin", "start", "signal", "exit", "reap"))
    parser.add_argument("--name", default="USR2")
    parser.add_argument("--pid", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--key", default="")
    parser.add_argument("--nodes", type=int, default=0, help="begin: the nodes a step trains on (0: the job's)")
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="none")
    parser.add_argument("--again", action="store_true", help="resume.in_job: exit 10 to train again in this job")
    parser.add_argument("--standby", default="", help="begin, exit: the warm standby step's folder (resume.in_job)")
    parser.add_argument("--per-node", type=int, default=0, help="begin: ranks per node; > 0: a warm standby step")
    parser.add_argument("--warm", action="store_true", help="start: the warm standby step trains this attempt")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    runner_log.setup(stamped=True)
    run = RunDir(args.run_dir)
    if args.what == "begin":
        events = run.events()
        code, env = begin(run, args.key, args.nodes, events)
        shell = warm_standby(events, code, env, args.standby, args.per_node) if args.per_node else {}
        print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()), end="", flush=True)
        print("".join(f"{k}={shlex.quote(v)}\n" for k, v in shell.items()), end="", flush=True)
        return code
    if args.what == "signal":
        return deliver(run, args.name, args.pid, args.world)
    if args.what == "reap":
        return reap(run, args.pid, args.world)
    if args.what == "start":
        job = slurmstates.job_id(os.environ)
        try:  # where this attempt's part of the batch output begins (the exit hook reads srun's words from there)
            offset = run.batch_log(job).stat().st_size if job else 0
        except OSError:
            offset = 0
        attempt = os.environ.get(ATTEMPT_ENV, "")  # `begin` claimed it: `runner logs --batch --attempt N` finds it
        where = os.environ.get(world.STEP_NODES_ENV) or os.environ.get("SLURM_JOB_NODELIST")
        said: dict[str, Any] = {"attempt": int(attempt)} if attempt.isdigit() else {}
        if args.warm:  # resume.in_job: the warm standby step trains this attempt
            said["warm"] = True
        run.record("start", job_id=job, nodes=where,
                   restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")), out_offset=offset, **said)
        return 0
    code = on_exit(run, args.rc, args.signal, args.again)
    if code != world.AGAIN:
        stand_down(args.standby)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
