"""One look at a run: what its directory says about itself and what Slurm says about its jobs, gathered once.

``runner status``, ``runner cron``, ``runner resume`` and the batch script's exit hook decide from the same facts:
the ledger, the exit status, the ``finished`` marker, the job id, the successor queued behind the job, the
manifest, the resolved config; and Slurm's answer for the job and its successor. ``observe`` reads each of them
once and returns them as one ``Observation``; what they mean is ``runner.policy``'s to say.

Slurm is asked only when the question needs it (``Need``: cron's, resume's and status's differ), and many runs
are asked about at once by their caller (``job_ids`` of each, one ``slurm.ask_many``), whose answer ``observe``
then takes instead of asking again.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from runner import goodput, policy, slurmstates
from runner.errors import RunnerError
from runner.host import scheduler, slurm, successor
from runner.records import RunManifest, run_manifest
from runner.rundir import RunDir, read_regular
from runner.spec.typed import RunConfig, read_resolved

# Whether Slurm's answer matters to a question, from the run's own records and manifest.
Need = Callable[[policy.Records, RunManifest], bool]
Ask = Callable[[list[str]], Mapping[str, slurmstates.JobInfo] | None]


def never(rec: policy.Records, manifest: RunManifest) -> bool:
    """The run's own records alone."""
    return False


def unsettled(rec: policy.Records, manifest: RunManifest) -> bool:
    """``runner cron``: Slurm's answer decides unless the records settle the run (``policy.settled``)."""
    return policy.settled(rec) is None


def resumable(rec: policy.Records, manifest: RunManifest) -> bool:
    """``runner resume``: whether the run's Slurm job may still be alive (one job trains a run at a time)."""
    return bool(rec.job_id) and not rec.finished and scheduler.of_manifest(manifest).queue


def shown(rec: policy.Records, manifest: RunManifest) -> bool:
    """``runner status``: whether Slurm's view can change the state shown (``policy.asks_slurm``)."""
    return scheduler.of_manifest(manifest).queue and policy.asks_slurm(rec)


def records(run: RunDir, job: str | None = None, events: list[dict[str, Any]] | None = None) -> policy.Records:
    """The run directory's facts, as ``runner.policy`` takes them: the ledger read once (``events``: the caller
    read it already). ``job``: the job whose successor counts (the exit hook's own; default the run's job)."""
    job_id = run.job_id()
    return policy.Records(events=run.events() if events is None else events, exit_status=run.exit_status_record(),
                          finished=run.finished.exists(), job_id=job_id,
                          successor=successor.following(run, job or job_id))


def job_ids(rec: policy.Records) -> list[str]:
    """The jobs whose Slurm state matters to a run: its job, and the successor queued behind it."""
    return [j for j in (rec.job_id, rec.successor) if j]


def manifest_of(run: RunDir) -> RunManifest:
    """The run's manifest (``records.run_manifest``: a field of the wrong type dropped); {} when there is none yet.
    Raises a one-line RunnerError when it is not a JSON object (a torn or hand-edited file): the caller shows that
    run as broken, never as another kind of run. ``RunDir.manifest_record`` is the lenient reader."""
    try:
        text = read_regular(run.manifest)  # a FIFO or a device is refused from its stat, never opened
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise RunnerError(f"{run.manifest}: cannot read it ({e.strerror}); expected a readable file. hint: check "
                          "its owner and mode") from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RunnerError(f"{run.manifest}: found invalid JSON ({e}); expected the manifest runner wrote. hint: "
                          "restore it, or move the run directory away") from None
    if not isinstance(manifest, dict):
        raise RunnerError(f"{run.manifest}: found a JSON {type(manifest).__name__}; expected a JSON object")
    return run_manifest(manifest)


@dataclass(frozen=True)
class Observation:
    """A run as one look found it. ``job`` and ``heir`` are Slurm's answers for ``records.job_id`` and
    ``records.successor`` (None: Slurm does not know the job, or was not asked because the question did not need
    it: ``needed``); ``asked`` is False when Slurm could not be asked at all."""

    run: RunDir
    records: policy.Records
    manifest: RunManifest
    needed: bool = False
    job: slurmstates.JobInfo | None = None
    heir: slurmstates.JobInfo | None = None
    asked: bool = True

    @property
    def scheduler(self) -> str | None:
        found = self.manifest.get("scheduler")
        return found if isinstance(found, str) else None

    @property
    def attempt(self) -> int:
        return policy.attempt(self.records.events)

    @functools.cached_property
    def attempts(self) -> list[goodput.Attempt]:
        """The run's attempts from its ledger (``goodput.attempts``), made once for every reader of this look."""
        return goodput.attempts(self.records.events)

    @functools.cached_property
    def config(self) -> RunConfig:
        """The resolved config, read on first use (a run settled by its records needs none)."""
        return read_resolved(self.run.config)

    def answered(self, jobs: Mapping[str, slurmstates.JobInfo] | None) -> Observation:
        """This look with Slurm's answer (``None``: Slurm could not be asked); unchanged when it is not needed."""
        if not self.needed:
            return self
        found = jobs or {}
        return replace(self, job=found.get(self.records.job_id or ""), heir=found.get(self.records.successor or ""),
                       asked=jobs is not None)


def look(run: RunDir, need: Need = never, strict: bool = False, job: str | None = None,
         events: list[dict[str, Any]] | None = None) -> Observation:
    """The run's own facts, without Slurm; ``needed`` says whether the question needs Slurm's answer (``ask``).
    ``strict``: a damaged manifest raises (``manifest_of``) instead of reading as none (said once). ``events``: the
    ledger, where the caller read it already (``runner report``)."""
    manifest = manifest_of(run) if strict else run.manifest_record() or {}
    rec = records(run, job, events)
    return Observation(run, rec, manifest, needed=need(rec, manifest))


def ask(looks: Iterable[Observation], using: Ask | None = None) -> Mapping[str, slurmstates.JobInfo] | None:
    """One question to Slurm for every look that needs its answer (``slurm.ask_many`` unless ``using``)."""
    ids = [j for o in looks if o.needed for j in job_ids(o.records)]
    if not ids:
        return {}
    return (using or slurm.ask_many)(ids)


def answer(seen: Observation, jobs: Mapping[str, slurmstates.JobInfo] | None = None, asked: bool = True,
           using: Ask | None = None) -> Observation:
    """A look with Slurm's answer where it needs one: ``jobs`` when the caller asked for many runs at once (``asked``
    False when it could not), else asked here for this run alone."""
    if jobs is not None:
        return replace(seen.answered(jobs), asked=asked)
    return seen.answered(ask([seen], using))


def observe(run: RunDir, need: Need = never, jobs: Mapping[str, slurmstates.JobInfo] | None = None, asked: bool = True,
            strict: bool = False, job: str | None = None, using: Ask | None = None,
            events: list[dict[str, Any]] | None = None) -> Observation:
    """One look at a run (``look``) with Slurm's answer where ``need`` says it matters (``answer``)."""
    return answer(look(run, need, strict, job, events), jobs, asked, using)
