"""The scheduler seam: where a run's attempts run, as one interface with two implementations (TorchX's scheduler
plugins).

``local`` runs the ranks on this machine under a driver that holds the run's owner lock; ``slurm`` queues a batch
job (and its successor) and asks Slurm about it. ``of`` is the one place a scheduler's name is compared: every other
module asks the scheduler it was given. A manifest that names neither (torn, hand-made, older) gets ``RECORDS``, which
says what the run directory alone can say and queues nothing.

    sched = scheduler.of(manifest.get("scheduler"))
    sched.state(run, records, job, heir)     # what status shows
    sched.cancel(run, job, wait_s)           # what `runner cancel` does
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from runner import alerts, ledger, policy, slurmstates, spec
from runner.alerts import nextstep
from runner.errors import SubmitError
from runner.host import local, nodes, slurm, successor
from runner.host.local import Owner
from runner.rundir import RunDir, atomic_write
from runner.spec.typed import RunConfig, read_resolved


@dataclass(frozen=True)
class Launch:
    """How a scheduler starts a run: the command, every other command it may run instead or after (each with why),
    and what the dry run says about them."""

    argv: list[str]
    also: list[tuple[list[str], str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Scheduler:
    """What a run directory alone can say of a run (its ledger and the local owner lock); the base of both schedulers.

    ``queue``: a queue outside the run directory knows the run's jobs: status and resume ask it, ``runner cron`` watches
    the run, bad nodes are left out of its jobs. ``detached``: ``start`` returns once the job is queued, not once the
    attempt has ended."""

    name: ClassVar[str] = "records"
    queue: ClassVar[bool] = False
    detached: ClassVar[bool] = False

    def uses_image(self, cfg: spec.Config) -> bool:
        """Whether an attempt runs in the config's image (``runner submit`` then checks the image first)."""
        return False

    def slurm_version(self) -> tuple[int, int] | None:
        """The site's Slurm version, for the batch script's options (``render.requeue_flag``); None where no Slurm
        runs the run."""
        return None

    def launch(self, run: RunDir, cfg: spec.Config, bad_nodes: Sequence[str]) -> Launch:
        """The command that starts an attempt, every other command starting it may run, and what the plan says about
        them (``--dry-run`` prints all three). ``bad_nodes``: those the run root remembers, oldest first."""
        raise SubmitError(f"{run.root}: no scheduler to start it under; expected scheduler: local or slurm")

    def start(self, run: RunDir, world_size: int) -> int:
        """Start the first attempt of a written run directory; returns the CLI's exit code."""
        raise SubmitError(f"{run.root}: no scheduler to start it under; expected scheduler: local or slurm")

    def hold(self, run: RunDir) -> Owner | None:
        """Before a resume changes anything: the run's owner lock where this scheduler's attempts hold one."""
        return None

    def restart(self, run: RunDir, cfg: RunConfig, reason: str, owner: Owner | None) -> int:
        """Start the next attempt of a stopped run (``runner resume``); returns the CLI's exit code."""
        raise SubmitError(f"{run.root}: no scheduler to start it under; expected scheduler: local or slurm")

    def state(self, run: RunDir, rec: policy.Records, job: slurmstates.JobInfo | None,
              heir: slurmstates.JobInfo | None) -> str:
        """The run's state as ``runner status`` shows it, from its records and the queue's answer (when asked)."""
        return policy.run_state(rec, job, heir)

    def ended(self, run: RunDir, job: str | None, events: Sequence[Mapping[str, Any]]) -> bool | None:
        """Whether anything more will be written to the run's logs; None when the queue cannot say (see
        ``status.ended``). Called once the records (``events``, the ledger as read) do not settle it."""
        return False

    def cancel(self, run: RunDir, job: str | None, wait_s: float) -> None:
        """Stop what runs of the run, and say so; the ``cancelled`` marker and ledger line are already written."""
        def starting() -> None:  # only the cancel that stops the processes says so; a second one waits for it
            print(f"cancelling {run.name}: its ranks checkpoint at the next step and exit", flush=True)
        stopped = local.cancel(run, wait_s, starting)  # the driver, when alive, records the end as cancelled
        status = run.exit_status_record() or {"exit_code": None, "time": 0.0}  # none of its processes ended yet
        run.write_exit_status({**status, "cancelled": True, "time": time.time()})
        print(f"cancelled {run.name}: {stopped}")


class Local(Scheduler):
    """The ranks on this machine, started by a driver that holds the run's owner lock while any of them lives."""

    name = "local"

    def launch(self, run: RunDir, cfg: spec.Config, bad_nodes: Sequence[str]) -> Launch:
        return Launch([sys.executable, "-m", "runner.job.launch", str(run.root)])

    def start(self, run: RunDir, world_size: int) -> int:
        owner = local.acquire(run)  # before the ledger says submitted: a live run always holds its lock
        run.record("submitted", scheduler="local", world_size=world_size)
        return local.run(run, world_size, owner)

    def hold(self, run: RunDir) -> Owner | None:
        return local.acquire(run)  # one trainer per run directory: refused while one lives

    def restart(self, run: RunDir, cfg: RunConfig, reason: str, owner: Owner | None) -> int:
        assert owner is not None, "Local.hold before Local.restart"
        run.record("resubmitted", scheduler="local", by="user")
        return local.run(run, cfg["num_nodes"] * cfg["num_device"], owner)

    def state(self, run: RunDir, rec: policy.Records, job: slurmstates.JobInfo | None,
              heir: slurmstates.JobInfo | None) -> str:
        return policy.local_run_state(rec, local.held(run))  # its processes hold its lock while any lives

    def ended(self, run: RunDir, job: str | None, events: Sequence[Mapping[str, Any]]) -> bool | None:
        return bool(events) and not local.held(run)


class Slurm(Scheduler):
    """A batch job per attempt (``sbatch``), a successor queued behind it (resume.successor), Slurm's word on both."""

    name = "slurm"
    queue = True
    detached = True

    def uses_image(self, cfg: spec.Config) -> bool:
        return cfg.data["container"]["runtime"] != "none"

    def slurm_version(self) -> tuple[int, int] | None:
        return slurm.version()

    def launch(self, run: RunDir, cfg: spec.Config, bad_nodes: Sequence[str]) -> Launch:
        script, notes, also = str(run.script), [], []
        if bad_nodes:
            notes.append(f"bad nodes:     {','.join(sorted(bad_nodes))} left out (`runner nodes` lists why); where "
                         "the partition (sinfo) cannot hold the job without them or sbatch refuses it, the oldest are "
                         "let back in one by one (ledger: bad_nodes_let_in)")
            also = [(slurm.sbatch_argv(script, nodes.exclude(bad_nodes[n:])), f"too few nodes without them: "
                     f"{','.join(bad_nodes[:n])} let back in") for n in range(1, len(bad_nodes) + 1)]
        if cfg.data["resume"]["successor"]:
            notes.append("successor:     the next attempt is queued behind each job (sbatch --dependency=afternotok:"
                         "JOB --kill-on-invalid-dep=yes, resume.successor)")
            also.append((slurm.sbatch_argv(script, nodes.exclude(bad_nodes), after="JOB"),
                         "the successor, JOB being the job sbatch named"))
        return Launch(slurm.sbatch_argv(script, nodes.exclude(bad_nodes)), also, notes)  # what nodes.submit runs first

    def start(self, run: RunDir, world_size: int) -> int:
        """``sbatch`` the run's script and record the job id.

        The directory exists before sbatch runs (the job may start within a second and writes into it); when sbatch
        refuses, it is removed again, so no run directory without a job id ever looks submitted."""
        cfg = read_resolved(run.config)
        try:
            job_id, let_in = _sbatch(run, cfg, "compare the config's num_nodes, num_device and slurm: block with "
                                               "`sinfo -N -o '%N %c %G'`")
        except BaseException:
            shutil.rmtree(run.root, ignore_errors=True)
            raise
        self.submitted(run, cfg, job_id, world_size, let_in)
        print(f"submitted job {job_id}: {run.root}")
        return 0

    def submitted(self, run: RunDir, cfg: RunConfig, job_id: str, world_size: int, let_in: Sequence[str]) -> None:
        """Make the job sbatch named (a job array's task: ``slurmstates.task_id``) the run's owner and record it: from
        here on the run is that job's, whether it came alone or as a sweep's task."""
        _own(run, cfg, job_id)
        fields: ledger.Submitted = {"scheduler": "slurm", "job_id": job_id, "world_size": world_size}
        if let_in:
            fields["bad_nodes_let_in"] = list(let_in)
        run.record("submitted", **fields)

    def restart(self, run: RunDir, cfg: RunConfig, reason: str, owner: Owner | None) -> int:
        job_id = self.resubmit(run, cfg, reason, by="user")
        print(f"resubmitted job {job_id}: {run.root}")
        return 0

    def resubmit(self, run: RunDir, cfg: RunConfig, reason: str, by: nextstep.By = "cron") -> str:
        """sbatch the run's script again, make the new job the run's owner, record it and alert; returns the id.

        A successor still queued behind an earlier job is cancelled (it would step aside anyway); with
        resume.successor the new job gets its own."""
        attempt = policy.attempt(run.events()) + 1
        job_id, let_in = _sbatch(run, cfg, "check the slurm: block against `sinfo`")
        _own(run, cfg, job_id)
        fields: ledger.Resubmitted = {"job_id": job_id, "reason": reason, "attempt": attempt, "by": by}
        if let_in:
            fields["bad_nodes_let_in"] = let_in
        run.record("resubmitted", **fields)
        alerts.notify(run.root, cfg["alerts"], "resubmitted", job_id=job_id, attempt=attempt,
                      next_step=nextstep.next_step("resubmitted", policy.Decision("resubmit", reason), attempt,
                                                 by=by, job_id=job_id))
        return job_id

    def ended(self, run: RunDir, job: str | None, events: Sequence[Mapping[str, Any]]) -> bool | None:
        if not job:
            return False
        info = slurm.query(job)
        return None if info is None else info.terminal

    def cancel(self, run: RunDir, job: str | None, wait_s: float) -> None:
        """scancel the job (every rank gets SIGTERM) and wait until Slurm says it ended; a successor queued behind it
        is cancelled first, so that it never starts."""
        if not job:
            super().cancel(run, job, wait_s)
            return
        heir = successor.queued(run)
        if heir is not None:
            successor.cancel(run, heir["job_id"], "cancelled by the user")
        complaint = slurm.cancel(job)
        deadline = time.monotonic() + wait_s
        info = slurm.query(job)
        while info is not None and not info.terminal and time.monotonic() < deadline:
            time.sleep(0.25)
            info = slurm.query(job)
        state = info.state if info else "unknown to Slurm"
        note = f"; scancel said: {complaint}" if complaint else ""
        print(f"cancelled {run.name} (job {job}: {state}){note}")


def _sbatch(run: RunDir, cfg: RunConfig, hint: str) -> tuple[str, list[str]]:
    """sbatch the run's script, bad nodes left out; returns the job id and the bad nodes let back in. A refusal is
    said in one line, with ``hint``."""
    try:
        return nodes.submit(str(run.script), run.root.parent, cfg["resume"]["exclude_nodes_s"],
                            needed=cfg["num_nodes"], partition=cfg["slurm"]["partition"])
    except SubmitError as e:
        raise refused(e, hint) from None


def _own(run: RunDir, cfg: RunConfig, job_id: str) -> None:
    """Make ``job_id`` the run's owner and queue its successor (resume.successor) in place of one still queued behind
    an earlier job (it would step aside anyway)."""
    atomic_write(run.job_id_file, job_id + "\n")
    stale = successor.queued(run)
    if stale is not None:
        successor.cancel(run, stale["job_id"], f"job {job_id} was resubmitted")
    successor.queue(run, cfg, job_id)


def refused(e: SubmitError, hint: str) -> SubmitError:
    """sbatch's refusal in one line: a controller that cannot be reached is named as such (the config is not to
    blame), anything else with ``hint``."""
    text = str(e)
    if not slurm.unreachable(text):
        return SubmitError(f"sbatch refused the job: {text}. hint: {hint}")
    conf = os.environ.get("SLURM_CONF")
    where = (f"SLURM_CONF={conf}: check that it names the cluster's slurm.conf and that its slurmctld runs "
             "(`scontrol ping`)" if conf else "SLURM_CONF is not set and no controller was found without it: export "
             "SLURM_CONF=/path/to/slurm.conf (`runner dev-cluster up` prints the line), or submit where Slurm is "
             "set up (`scontrol ping` answers)")
    said = text if text.startswith(slurm.NO_CONF) else f"sbatch said: {text}"  # sbatch never ran
    return SubmitError(f"no Slurm controller answers: {said}. hint: {where}")


RECORDS = Scheduler()
LOCAL = Local()
SLURM = Slurm()
_BY_NAME: dict[object, Scheduler] = {s.name: s for s in (LOCAL, SLURM)}


def of(name: object) -> Scheduler:
    """The scheduler a config or manifest names (``scheduler:``); ``RECORDS`` for anything else."""
    return _BY_NAME.get(name, RECORDS) if isinstance(name, str) else RECORDS


def of_manifest(manifest: Any) -> Scheduler:
    """The scheduler a run's manifest names (a dict as ``observe.manifest_of`` reads it)."""
    return of(manifest.get("scheduler") if isinstance(manifest, dict) else None)
