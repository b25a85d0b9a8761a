"""Talking to Slurm: submit with sbatch, read job state from sacct, squeue or scontrol, cancel with scancel.

Every parser takes the text a command printed and returns plain values, so that it is unit-tested against
output recorded from a real Slurm (tests/fixtures/slurm/). The query functions are thin: run one command
through ``proc.run``, hand its stdout to a parser.

Which source to believe (measured on 22.05 with slurmdbd): ``sacct`` survives ``MinJobAge`` but lags the
controller by up to a second or two (a RUNNING job can still read PENDING, a new job can be missing), while
``squeue``/``scontrol`` are the controller's live view but forget a job after ``MinJobAge``. So a terminal
state from sacct is final; anything else is checked against the controller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runner import proc
from runner.errors import SubmitError

SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed")
SQUEUE_FORMAT = "%i|%T|%r|%N"

# Slurm's job states (squeue/scontrol spelling) -> runner's states.
_STATE_MAP = {
    "PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
    "STAGE_OUT": "running", "SIGNALING": "running", "RESIZING": "running", "SUSPENDED": "running",
    "STOPPED": "running", "RESV_DEL_HOLD": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
    "REQUEUE_FED": "pending", "SPECIAL_EXIT": "pending", "REVOKED": "cancelled",
    "COMPLETED": "completed", "FAILED": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "PREEMPTED": "preempted",
}
TERMINAL = frozenset({"COMPLETED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "CANCELLED", "TIMEOUT",
                      "DEADLINE", "PREEMPTED", "REVOKED"})
_ERROR_PREFIX = re.compile(r"^(sbatch|sacct|squeue|scontrol|scancel|srun|salloc): error: ")


@dataclass(frozen=True)
class JobInfo:
    """One job as a Slurm command reported it."""

    job_id: str
    state: str  # Slurm's own word: RUNNING, COMPLETED, CANCELLED, ...
    source: str  # sacct, squeue or scontrol
    exit_code: str | None = None  # "3:0" = exit code 3, signal 0
    reason: str | None = None
    nodes: str | None = None
    restarts: int | None = None

    @property
    def runner_state(self) -> str | None:
        return normalize(self.state)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def base_state(raw: str) -> str:
    """'CANCELLED by 0' -> 'CANCELLED'; 'COMPLETING+' -> 'COMPLETING' (sacct's and scontrol's decorations)."""
    words = raw.strip().split()
    return words[0].rstrip("+").upper() if words else ""


def normalize(raw: str) -> str | None:
    """Map a Slurm state ('CANCELLED by 0', 'RUNNING') to runner's states; None for an unknown word."""
    return _STATE_MAP.get(base_state(raw))


# ---------------------------------------------------------------------------------------------------------------
# Parsers (pure; tested against recorded output)


def parse_sbatch(stdout: str) -> str:
    """The job id from ``sbatch --parsable``: ``12`` or ``12;cluster`` (a warning may precede it)."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    job = lines[-1].split(";")[0] if lines else ""
    if not job.isdigit():
        raise SubmitError(f"sbatch: found {stdout.strip()[:80]!r} on stdout; expected a job id. "
                          "hint: is `sbatch` the Slurm one?")
    return job


def error_line(stderr: str, fallback: str = "") -> str:
    """The command's own error message on one line, without its ``sbatch: error:`` prefix.

    Slurm prints the reason on the last ``error:`` line ("Batch job submission failed: Requested node
    configuration is not available"); earlier ones are context ("Memory specification can not be satisfied").
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [_ERROR_PREFIX.sub("", line) for line in lines if _ERROR_PREFIX.match(line)]
    if errors:
        return errors[-1]
    return lines[-1] if lines else fallback


def parse_sacct(text: str, job_id: str, fields: tuple[str, ...] = SACCT_FIELDS) -> JobInfo | None:
    """``sacct -X -n -P --format=<fields>``: the job's current row (with ``-D`` the last of its attempts)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(fields):
            continue
        row = dict(zip(fields, values, strict=True))
        if row.get("JobID") == job_id:
            rows.append(row)
    if not rows:
        return None
    row = rows[-1]
    requeues = sum(1 for r in rows if base_state(r["State"]) == "REQUEUED")  # one row per attempt with -D
    nodes = row.get("NodeList")
    return JobInfo(job_id=job_id, state=base_state(row["State"]), source="sacct", exit_code=row.get("ExitCode"),
                   nodes=None if nodes in (None, "", "None assigned") else nodes, restarts=requeues)


def parse_squeue(text: str, job_id: str) -> JobInfo | None:
    """``squeue -h -t all -j ID -o '%i|%T|%r|%N'``."""
    for line in text.splitlines():
        values = line.strip().split("|")
        if len(values) >= 2 and values[0] == job_id:
            reason = values[2] if len(values) > 2 and values[2] not in ("", "None") else None
            nodes = values[3] if len(values) > 3 and values[3] else None
            return JobInfo(job_id=job_id, state=base_state(values[1]), source="squeue", reason=reason, nodes=nodes)
    return None


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_pairs(text: str) -> dict[str, str]:
    """``scontrol show job ID`` as a dict. Values run to the next `` Key=`` on the line (paths may hold spaces)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        matches = list(_KEY.finditer(line))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            out.setdefault(m.group(1), line[m.end():end].strip())
    return out


def parse_scontrol(text: str, job_id: str) -> JobInfo | None:
    pairs = parse_scontrol_pairs(text)
    if pairs.get("JobId") != job_id or "JobState" not in pairs:
        return None
    reason = pairs.get("Reason")
    restarts = pairs.get("Restarts", "")
    return JobInfo(job_id=job_id, state=base_state(pairs["JobState"]), source="scontrol",
                   exit_code=pairs.get("ExitCode"), reason=None if reason in (None, "", "None") else reason,
                   nodes=pairs.get("NodeList") or None, restarts=int(restarts) if restarts.isdigit() else None)


# ---------------------------------------------------------------------------------------------------------------
# Commands


def submit(script: str, env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable SCRIPT`` in a clean environment; returns the job id or raises SubmitError with
    sbatch's own reason."""
    argv = ["sbatch", "--parsable", script]
    out = proc.run(argv, timeout=60, check=False, env=env, clean=env is None)
    if out.returncode == proc.NOT_FOUND:
        raise SubmitError("sbatch: command not found. hint: run on a Slurm login node, or set scheduler: local")
    if out.returncode == proc.TIMED_OUT:
        raise SubmitError("sbatch: no answer within 60 s. hint: is slurmctld up? try `sinfo`")
    if out.returncode != 0:
        raise SubmitError(error_line(out.stderr or out.stdout, f"exit code {out.returncode}"))
    return parse_sbatch(out.stdout)


def _try(argv: list[str]) -> str | None:
    try:
        return proc.run(argv, timeout=15).stdout
    except SubmitError:
        return None


def sacct(job_id: str) -> JobInfo | None:
    """From accounting; None without accounting (no sacct, or "accounting storage is disabled")."""
    out = _try(["sacct", "-X", "-n", "-P", "-D", "-j", job_id, f"--format={','.join(SACCT_FIELDS)}"])
    return parse_sacct(out, job_id) if out is not None else None


def squeue(job_id: str) -> JobInfo | None:
    """From the controller; None once the job is older than MinJobAge ("Invalid job id specified")."""
    out = _try(["squeue", "-h", "-t", "all", "-j", job_id, "-o", SQUEUE_FORMAT])
    return parse_squeue(out, job_id) if out is not None else None


def scontrol(job_id: str) -> JobInfo | None:
    out = _try(["scontrol", "show", "job", job_id])
    return parse_scontrol(out, job_id) if out is not None else None


def query(job_id: str) -> JobInfo | None:
    """The job's best-known state: sacct's if final, else the controller's live one, else whatever sacct had."""
    acct = sacct(job_id)
    if acct is not None and acct.terminal:
        return acct
    live = squeue(job_id) or scontrol(job_id)
    return live or acct


def job_state(job_id: str) -> str | None:
    """The job's state in runner's words, or None when Slurm does not know it (any more)."""
    info = query(job_id)
    return info.runner_state if info else None


def cancel(job_id: str) -> str | None:
    """``scancel ID``; returns scancel's complaint (e.g. the job already ended), or None."""
    try:
        proc.run(["scancel", job_id], timeout=30)
    except SubmitError as e:
        return str(e)
    return None
