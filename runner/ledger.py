"""The run's ledger as data: every event name, the fields of each, and the names an alert can carry.

A run's ``ledger.jsonl`` is how its processes talk to each other across time and machines: the batch script's
hooks, the ranks, ``runner cron``, ``runner status`` and a person's ``runner resume`` each append a line and read
the others'. The names and fields live here, once: ``RunDir.record`` takes exactly the fields of the event it is
given (``EVENT_FIELDS``, checked by mypy through the overloads of ``Ledger.record``), and ``normalize`` reads the
lines that runs written by an older runner left behind (an ``exit`` of ``runner parallel`` with ``rc=``).

Standard library only: the login node, the batch host and the ranks import it (and the batch script's bash writes
``hook_failed`` with the same fields, ``templates/sbatch.sh.j2``).
"""

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, TypeGuard, Unpack, get_args, overload

# ---------------------------------------------------------------------------------------------------------------
# The names

EventName = Literal[
    # a submission and its jobs (the login node, the batch script's hooks)
    "submitted", "resubmitted", "resized", "cancelled", "start", "exit", "superseded", "requeued",
    "restarted", "nodes_lost", "requeue_failed", "handed_over", "took_over", "stopped", "gave_up", "hook_failed",
    "hook_failure_alerted",
    # resume.successor: the job queued behind the run's job
    "successor_queued", "successor_failed", "successor_cancelled",
    # the ranks
    "preflight", "train_start", "resumed", "data", "nonfinite", "nonfinite_skipped", "hang", "straggler",
    "straggler_alert", "program_error", "finished", "checkpoint_unloadable",
]
EVENT_NAMES: tuple[EventName, ...] = get_args(EventName)

# The outcomes of an attempt (an ``exit``'s ``outcome``) and the other news an alert is sent for (alerts.events).
AlertEvent = Literal["failed", "preempted", "requeued", "timeout", "resubmitted", "gave_up", "completed",
                     "cancelled", "preflight_failed", "hang", "nan", "straggler"]
ALERT_EVENTS: tuple[AlertEvent, ...] = get_args(AlertEvent)

def is_alert_event(name: str) -> TypeGuard[AlertEvent]:
    """Whether an alert is ever sent for ``name`` (an outcome such as ``superseded`` is none)."""
    return name in ALERT_EVENTS


# Why an attempt ended, as ``runner.alerts.causes.Cause`` names it (the exit's ``cause`` is its sentence).
CauseKind = Literal["oom", "node_failure", "time_limit", "preemption", "nccl_timeout", "program", "exception",
                    "crash_loop", "bad_nodes", "nan", "hang", "rank", "hook", "unknown"]
CAUSE_KINDS: tuple[CauseKind, ...] = get_args(CauseKind)

# How an attempt ended (``policy.classify``, the local driver, ``runner parallel``): an ``exit``'s ``outcome``.
Outcome = Literal["completed", "failed", "cancelled", "preflight_failed", "hang", "nan", "timeout", "preempted",
                  "superseded", "interrupted", "stopped"]


# ---------------------------------------------------------------------------------------------------------------
# The fields of each event (``time`` and ``event`` are added by the writer)


class Submitted(TypedDict):
    scheduler: NotRequired[str]  # slurm or local
    job_id: NotRequired[str | None]
    world_size: NotRequired[int]
    bad_nodes_let_in: NotRequired[list[str]]  # resume.exclude_nodes_s left no other nodes
    kind: NotRequired[str]  # "parallel": a `runner parallel` run
    env: NotRequired[str]  # runner parallel's environment


class Resubmitted(Submitted):
    reason: NotRequired[str]
    attempt: NotRequired[int]
    by: NotRequired[str]  # cron, the exit hook, or "user" (`runner resume`: a fresh restart budget)


class Resized(TypedDict):
    change: str
    world_size: int
    accumulate: int | None


class Cancelled(TypedDict):
    job_id: str | None


class Start(TypedDict):
    job_id: NotRequired[str | None]
    nodes: NotRequired[str | None]
    restart_count: NotRequired[int]
    out_offset: NotRequired[int]  # where this attempt's part of the batch output begins
    attempt: NotRequired[int]  # the attempt the job runs (a Slurm job's `start`, runner parallel's)
    items_left: NotRequired[int]  # runner parallel
    warm: NotRequired[bool]  # resume.in_job: the warm standby step trains this attempt (runner.job.standby)


class Exit(TypedDict):
    """An attempt ended: one shape for a Slurm job (the exit hook), a local run and ``runner parallel``."""

    outcome: Outcome
    exit_code: int  # the launcher's (the driver's): 75 asks for a requeue, see ``runner.rundir``
    attempt: int
    job_id: NotRequired[str | None]  # Slurm only
    signal: NotRequired[str]  # the signal the batch script got ("none")
    cause: NotRequired[str | None]  # the line alerts and status show
    crash: NotRequired[dict[str, Any] | None]  # the first failing rank's crash record (type, message, frame, step)
    nodes: NotRequired[list[str]]  # the nodes this attempt named bad (a hang's suspects, preflight's failures)
    codes: NotRequired[list[int]]  # a local run: each rank's exit code
    scheduler: NotRequired[str]  # "local" for a local run
    items_done: NotRequired[int]  # runner parallel
    items_failed: NotRequired[int]  # runner parallel


class Superseded(TypedDict):
    job_id: str | None
    owner: str | None
    exit_code: int


class Requeued(TypedDict):
    job_id: str | None
    reason: str
    attempt: int


class NodesLost(TypedDict):
    """The step reaper (resume.in_job with spares) ended a step on nodes it found lost before Slurm marked them down:
    their ranks silent, their peers failed (``runner.policy.lost_nodes``)."""

    job_id: str | None
    attempt: int
    nodes: list[str]
    silent_s: float  # how long their ranks had not beaten when the step was ended


class Restarted(TypedDict):
    """resume.in_job: the batch script trains again in the same job (a new step, a new attempt) on ``nodes``,
    without ``bad`` (the nodes named bad in this job so far)."""

    job_id: str | None
    reason: str
    attempt: int
    nodes: list[str]
    bad: list[str]


class RequeueFailed(TypedDict):
    job_id: str | None
    reason: str
    error: str


class HandedOver(TypedDict):
    job_id: str | None
    successor: str | None
    reason: str
    attempt: int
    delay_s: float


class TookOver(TypedDict):
    job_id: str
    after: str
    reason: str


class Stopped(TypedDict):
    job_id: NotRequired[str | None]
    reason: str


class GaveUp(TypedDict):
    job_id: NotRequired[str | None]
    reason: str


class HookFailed(TypedDict):
    """Written by the batch script's bash when a hook itself failed (``templates/sbatch.sh.j2``)."""

    exit_code: int
    hook: str
    job_id: str


class HookFailureAlerted(TypedDict):
    of: float  # the ``time`` of the hook_failed line it alerted for


class SuccessorQueued(TypedDict):
    job_id: str
    after: str


class SuccessorFailed(TypedDict):
    after: str
    error: str


class SuccessorCancelled(TypedDict):
    job_id: str
    reason: str
    error: NotRequired[str]


class Preflight(TypedDict):
    status: str  # pass, warn or fail
    duration_s: float
    summary: str


class TrainStart(TypedDict):
    step: int
    lost_steps: int
    attempt: int
    resumed_from: str | None


class Resumed(TypedDict, total=False):
    """The honesty record of a resume (``runner.job.honesty.Resumed``'s fields)."""

    step: int
    epoch: int
    from_world: int
    to_world: int
    from_accumulate: int | None
    to_accumulate: int
    global_batch: int | None
    samples: int | None
    epoch_batches: int | None
    epoch_batches_now: int | None
    mid_epoch: bool
    state: str
    trajectory: str
    data: str
    data_exact: bool
    first_step_samples: int | None
    reshaped: bool


class Data(TypedDict):
    exactness: str
    global_batch: int | None
    configured_global_batch: int | None
    local_batch: int | None


class Nonfinite(TypedDict):
    step: int
    what: str
    skipped_in_a_row: int


class NonfiniteSkipped(TypedDict):
    step: int
    what: str


class CheckpointUnloadable(TypedDict):
    """A complete checkpoint that verified yet failed to load (``runner.job.fallback``): skipped from then on."""

    step: int
    path: str
    why: str  # the failure, one line


class Hang(TypedDict):
    summary: str
    nodes: list[str]
    step: int | None


class Straggler(TypedDict):
    rank: int
    node: str
    slow: str  # compute or data
    step: int
    compute_x: float
    data_x: float
    compute_s: float
    data_s: float
    attempt: int


class StragglerAlert(TypedDict):
    rank: int | None
    attempt: int | None
    queued: bool


class ProgramError(TypedDict):
    reason: Literal["not_found", "missing_package", "no_training", "world_size"]
    detail: str


class Finished(TypedDict, total=False):
    step: int | None
    lightning: bool  # program mode: False when the program trained without Lightning


EVENT_FIELDS: dict[EventName, type[Mapping[str, Any]]] = {
    "submitted": Submitted, "resubmitted": Resubmitted, "resized": Resized, "cancelled": Cancelled, "start": Start,
    "exit": Exit, "superseded": Superseded, "requeued": Requeued, "restarted": Restarted, "nodes_lost": NodesLost,
    "requeue_failed": RequeueFailed,
    "handed_over": HandedOver, "took_over": TookOver, "stopped": Stopped, "gave_up": GaveUp,
    "hook_failed": HookFailed, "hook_failure_alerted": HookFailureAlerted, "successor_queued": SuccessorQueued,
    "successor_failed": SuccessorFailed, "successor_cancelled": SuccessorCancelled, "preflight": Preflight,
    "train_start": TrainStart, "resumed": Resumed, "data": Data, "nonfinite": Nonfinite,
    "nonfinite_skipped": NonfiniteSkipped, "hang": Hang, "straggler": Straggler, "straggler_alert": StragglerAlert,
    "program_error": ProgramError, "finished": Finished, "checkpoint_unloadable": CheckpointUnloadable,
}


class UnknownEvent(ValueError):
    """A write of an event name the ledger does not know: a bug of the writer, never data."""


# ---------------------------------------------------------------------------------------------------------------
# Writing: one door, typed per event


class Ledger:
    """The typed door of a run's ledger; ``runner.rundir.RunDir`` is one and does the writing (``_append``)."""

    @overload
    def record(self, event: Literal["submitted"], **fields: Unpack[Submitted]) -> None: ...
    @overload
    def record(self, event: Literal["resubmitted"], **fields: Unpack[Resubmitted]) -> None: ...
    @overload
    def record(self, event: Literal["resized"], **fields: Unpack[Resized]) -> None: ...
    @overload
    def record(self, event: Literal["cancelled"], **fields: Unpack[Cancelled]) -> None: ...
    @overload
    def record(self, event: Literal["start"], **fields: Unpack[Start]) -> None: ...
    @overload
    def record(self, event: Literal["exit"], **fields: Unpack[Exit]) -> None: ...
    @overload
    def record(self, event: Literal["superseded"], **fields: Unpack[Superseded]) -> None: ...
    @overload
    def record(self, event: Literal["requeued"], **fields: Unpack[Requeued]) -> None: ...
    @overload
    def record(self, event: Literal["restarted"], **fields: Unpack[Restarted]) -> None: ...
    @overload
    def record(self, event: Literal["nodes_lost"], **fields: Unpack[NodesLost]) -> None: ...
    @overload
    def record(self, event: Literal["requeue_failed"], **fields: Unpack[RequeueFailed]) -> None: ...
    @overload
    def record(self, event: Literal["handed_over"], **fields: Unpack[HandedOver]) -> None: ...
    @overload
    def record(self, event: Literal["took_over"], **fields: Unpack[TookOver]) -> None: ...
    @overload
    def record(self, event: Literal["stopped"], **fields: Unpack[Stopped]) -> None: ...
    @overload
    def record(self, event: Literal["gave_up"], **fields: Unpack[GaveUp]) -> None: ...
    @overload
    def record(self, event: Literal["hook_failed"], **fields: Unpack[HookFailed]) -> None: ...
    @overload
    def record(self, event: Literal["hook_failure_alerted"], **fields: Unpack[HookFailureAlerted]) -> None: ...
    @overload
    def record(self, event: Literal["successor_queued"], **fields: Unpack[SuccessorQueued]) -> None: ...
    @overload
    def record(self, event: Literal["successor_failed"], **fields: Unpack[SuccessorFailed]) -> None: ...
    @overload
    def record(self, event: Literal["successor_cancelled"], **fields: Unpack[SuccessorCancelled]) -> None: ...
    @overload
    def record(self, event: Literal["preflight"], **fields: Unpack[Preflight]) -> None: ...
    @overload
    def record(self, event: Literal["train_start"], **fields: Unpack[TrainStart]) -> None: ...
    @overload
    def record(self, event: Literal["resumed"], **fields: Unpack[Resumed]) -> None: ...
    @overload
    def record(self, event: Literal["data"], **fields: Unpack[Data]) -> None: ...
    @overload
    def record(self, event: Literal["nonfinite"], **fields: Unpack[Nonfinite]) -> None: ...
    @overload
    def record(self, event: Literal["nonfinite_skipped"], **fields: Unpack[NonfiniteSkipped]) -> None: ...
    @overload
    def record(self, event: Literal["checkpoint_unloadable"], **fields: Unpack[CheckpointUnloadable]) -> None: ...
    @overload
    def record(self, event: Literal["hang"], **fields: Unpack[Hang]) -> None: ...
    @overload
    def record(self, event: Literal["straggler"], **fields: Unpack[Straggler]) -> None: ...
    @overload
    def record(self, event: Literal["straggler_alert"], **fields: Unpack[StragglerAlert]) -> None: ...
    @overload
    def record(self, event: Literal["program_error"], **fields: Unpack[ProgramError]) -> None: ...
    @overload
    def record(self, event: Literal["finished"], **fields: Unpack[Finished]) -> None: ...

    def record(self, event: EventName, **fields: Any) -> None:
        """Append one event to the run's ledger (one JSON object per line, fsynced). An unknown name is refused:
        a line nobody reads is an alert that never comes."""
        if event not in EVENT_FIELDS:
            raise UnknownEvent(f"unknown ledger event {event!r}; expected one of {', '.join(EVENT_NAMES)}")
        self._append(event, fields)

    def _append(self, event: EventName, fields: Mapping[str, Any]) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------------------
# Reading: tolerant of every line an older runner wrote


def normalize(line: dict[str, Any]) -> dict[str, Any]:
    """A ledger line in today's shape. Runs written before the ``exit`` event had one shape stay readable:
    ``runner parallel`` wrote its exit code as ``rc``. Anything else is left as it is (a reader asks with ``get``)."""
    if line.get("event") == "exit" and "exit_code" not in line and "rc" in line:
        line = {**line, "exit_code": line["rc"]}
        del line["rc"]
    return line
