"""Talking to Slurm: submit with sbatch, read job state from sacct, squeue or scontrol, cancel with scancel.

Every parser takes the text a command printed and returns plain values, so that it is unit-tested against
output recorded from a real Slurm (tests/fixtures/slurm/). The query functions are thin: run one command
through ``proc.run``, hand its stdout to a parser. Slurm's state words and what they mean to runner are part of
the recovery decisions and live in ``runner.policy``.

Which source to believe (measured on 22.05 with slurmdbd): ``sacct`` survives ``MinJobAge`` but lags the
controller by up to a second or two (a RUNNING job can still read PENDING, a new job can be missing), while
``squeue``/``scontrol`` are the controller's live view but forget a job after ``MinJobAge``. So a terminal
state from sacct is final; anything else is checked against the controller; and a non-final sacct row is
still better than nothing when the controller forgot the job.

Many runs are asked about at once (``query_many``): one sacct for all of them, one squeue for those sacct did
not report ended, and ``scontrol show job`` (one command per job) only for a few that neither knew.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from collections.abc import Iterable, Sequence

from runner import proc
from runner.errors import SubmitError
from runner.rundir import SUCCESSOR_ENV
from runner.slurmstates import TERMINAL as TERMINAL  # Slurm's vocabulary, shared with the decisions (runner.policy)
from runner.slurmstates import JobInfo as JobInfo
from runner.slurmstates import base_state as base_state
from runner.slurmstates import job_ids
from runner.slurmstates import normalize as normalize

SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed")
SQUEUE_FORMAT = "%i|%T|%r|%N"

_ERROR_PREFIX = re.compile(r"^(sbatch|sacct|squeue|scontrol|scancel|srun|salloc): error: ")


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


def _ids(field: str) -> list[str]:
    """The jobs a row's id stands for (``slurmstates.job_ids``: an array's pending tasks, one row, each by its own
    id); an id of another shape is kept as Slurm printed it."""
    return job_ids(field) or ([field.strip()] if "[" not in field else [])


def parse_sacct_many(text: str, fields: tuple[str, ...] = SACCT_FIELDS) -> dict[str, JobInfo]:
    """``sacct -X -n -P -D --format=<fields> -j ID,ID,...``: each job's current row (the last of its attempts). An
    array task is ``12_3``; tasks still in the queue share one row (``12_[3-9%2]``), which answers for each."""
    rows: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(fields):
            continue
        row = dict(zip(fields, values, strict=True))
        for job in _ids(row.get("JobID", "")):
            rows.setdefault(job, []).append(row)
    out = {}
    for job_id, attempts in rows.items():
        row = attempts[-1]
        requeues = sum(1 for r in attempts if base_state(r["State"]) == "REQUEUED")  # one row per attempt with -D
        nodes = row.get("NodeList")
        out[job_id] = JobInfo(job_id=job_id, state=base_state(row["State"]), source="sacct",
                              exit_code=row.get("ExitCode"), nodes=None if nodes in (None, "", "None assigned")
                              else nodes, restarts=requeues)
    return out


def parse_sacct(text: str, job_id: str, fields: tuple[str, ...] = SACCT_FIELDS) -> JobInfo | None:
    """``sacct -X -n -P --format=<fields>``: the job's current row (with ``-D`` the last of its attempts)."""
    return parse_sacct_many(text, fields).get(job_id)


def parse_squeue_many(text: str) -> dict[str, JobInfo]:
    """``squeue -h -r -t all -j ID,ID,... -o '%i|%T|%r|%N'``: every job it listed (an array task as ``12_3``; without
    ``-r`` the tasks still in the queue share one row, ``12_[3-9%2]``, which answers for each)."""
    out: dict[str, JobInfo] = {}
    for line in text.splitlines():
        values = line.strip().split("|")
        if len(values) < 2 or not values[0]:
            continue
        reason = values[2] if len(values) > 2 and values[2] not in ("", "None") else None
        nodes = values[3] if len(values) > 3 and values[3] else None
        for job in _ids(values[0]):
            if job not in out:
                out[job] = JobInfo(job_id=job, state=base_state(values[1]), source="squeue", reason=reason,
                                   nodes=nodes)
    return out


def parse_squeue(text: str, job_id: str) -> JobInfo | None:
    """``squeue -h -t all -j ID -o '%i|%T|%r|%N'``."""
    return parse_squeue_many(text).get(job_id)


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


def _scontrol_ids(pairs: dict[str, str]) -> list[str]:
    """The jobs one ``scontrol show job`` record stands for: its ``JobId``, and an array task's ``ARRAY_TASK``
    (each of a range)."""
    array, tasks = pairs.get("ArrayJobId", ""), pairs.get("ArrayTaskId", "")
    mine = job_ids(f"{array}_{tasks}" if tasks.isdigit() else f"{array}_[{tasks}]") if array and tasks else []
    return [*mine, pairs.get("JobId", "")]


def parse_scontrol(text: str, job_id: str) -> JobInfo | None:
    """``scontrol show job ID``: the record of ``job_id``. An array task's record says ``JobId=<its own number>
    ArrayJobId=12 ArrayTaskId=3``; tasks still in the queue share one (``ArrayTaskId=3-9%2``); asked for an array's
    id, scontrol prints a record per task, separated by blank lines."""
    pairs = next((p for p in map(parse_scontrol_pairs, re.split(r"\n\s*\n", text)) if job_id in _scontrol_ids(p)),
                 {})
    if "JobState" not in pairs:
        return None
    reason = pairs.get("Reason")
    restarts = pairs.get("Restarts", "")
    return JobInfo(job_id=job_id, state=base_state(pairs["JobState"]), source="scontrol",
                   exit_code=pairs.get("ExitCode"), reason=None if reason in (None, "", "None") else reason,
                   nodes=pairs.get("NodeList") or None, restarts=int(restarts) if restarts.isdigit() else None)


def parse_time_left(text: str) -> float | None:
    """squeue's ``%L`` (``[D-]HH:MM:SS``, ``MM:SS``) in seconds; None for UNLIMITED and the like."""
    text = text.strip()
    if not text or text in ("UNLIMITED", "NOT_SET", "INVALID"):
        return None
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        whole_days = int(days or 0)
    except ValueError:
        return None
    while len(parts) < 3:
        parts.insert(0, 0)
    return (whole_days * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


# ---------------------------------------------------------------------------------------------------------------
# Commands


def successor_args(after: str) -> list[str]:
    """sbatch options of a successor job (resume.successor): it may start once job ``after`` ended in a failed
    state (non-zero exit, time limit, node failure, cancelled), and Slurm cancels it once that can never happen
    (``after`` COMPLETED), whatever the site's default for an unsatisfiable dependency."""
    return [f"--dependency=afternotok:{after}", "--kill-on-invalid-dep=yes"]


# What sbatch, squeue and scontrol say when no controller can be reached (no SLURM_CONF and no configless DNS record,
# a missing slurm.conf, slurmctld down): the cluster, not the job, is the problem.
NO_CONF = "SLURM_CONF names no file"  # said before sbatch runs (it would wait 60 s for the file to appear)
_UNREACHABLE = (NO_CONF, "_establish_config_source", "failed to fetch config",
                "Could not establish a configuration source", "Unable to contact slurm controller",
                "ClusterName needs to be specified",
                "Zero Bytes were transmitted or received", "Socket timed out on send/recv operation")


def unreachable(text: str) -> bool:
    """Whether a Slurm command's complaint says that no controller answers."""
    return any(p.lower() in text.lower() for p in _UNREACHABLE)

def sbatch_argv(script: str, extra: Sequence[str] = (), after: str | None = None) -> list[str]:
    """The sbatch command line of a submission: ``submit`` runs it, ``runner submit --dry-run`` prints it.
    ``extra`` are options that win over the script's #SBATCH lines (``--exclude``); ``after`` queues a successor of
    that job (``successor_args``)."""
    return ["sbatch", "--parsable", *extra, *(successor_args(after) if after else ()), script]


def submit(script: str, env: dict[str, str] | None = None, extra: Sequence[str] = (), after: str | None = None) -> str:
    """``sbatch_argv`` run in a clean environment; returns the job id or raises SubmitError with sbatch's own reason.

    ``after``: queue a successor of that job; its batch script finds the job it follows in ``SUCCESSOR_ENV``, which no
    other job inherits (a successor that resubmits a run submits a plain job).
    """
    argv = sbatch_argv(script, extra, after)
    job_env = proc.clean_env() if env is None else dict(env)
    conf = job_env.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # Slurm would wait 60 s for it to appear (an NFS mount coming up) first
        raise SubmitError(f"{NO_CONF} ({conf})")
    job_env.pop(SUCCESSOR_ENV, None)
    if after:
        job_env[SUCCESSOR_ENV] = after
    out = proc.run(argv, timeout=60, check=False, env=job_env)
    if out.returncode == proc.NOT_FOUND:
        raise SubmitError("sbatch: command not found. hint: run on a Slurm login node, or set scheduler: local")
    if out.returncode == proc.TIMED_OUT:
        raise SubmitError("sbatch: no answer within 60 s. hint: is slurmctld up? try `sinfo`")
    if out.returncode != 0:
        raise SubmitError(error_line(out.stderr or out.stdout, f"exit code {out.returncode}"))
    return parse_sbatch(out.stdout)


QUERY_TIMEOUT_S = 15
MAX_SCONTROL = 8  # per query_many: a job that sacct and squeue both forgot is usually long gone
CHUNK = 1000  # job ids per sacct/squeue command (a command line has a length limit)


# What Slurm prints when it was asked and does not know a job: an answer, unlike a timeout or "Unable to contact".
_UNKNOWN_JOB = "Invalid job id specified"


class _Asked:
    """Whether any Slurm command of one query answered (exit 0, or "Invalid job id": it knows nothing of it)."""

    answered = False


def _try(argv: list[str], asked: _Asked | None = None) -> str | None:
    out = proc.run(argv, timeout=QUERY_TIMEOUT_S, check=False)
    if asked is not None and (out.returncode == 0 or _UNKNOWN_JOB in out.stderr):
        asked.answered = True
    return out.stdout if out.returncode == 0 else None


def _chunks(ids: list[str]) -> list[list[str]]:
    return [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)]


def sacct_many(job_ids: list[str], asked: _Asked | None = None) -> dict[str, JobInfo]:
    """From accounting; empty without accounting (no sacct, or "accounting storage is disabled")."""
    out: dict[str, JobInfo] = {}
    for chunk in _chunks(job_ids):
        argv = ["sacct", "-X", "-n", "-P", "-D", "-j", ",".join(chunk), f"--format={','.join(SACCT_FIELDS)}"]
        text = _try(argv, asked)
        found = parse_sacct_many(text) if text is not None else {}
        out.update((job, found[job]) for job in chunk if job in found)
    return out


def squeue_many(job_ids: list[str], asked: _Asked | None = None) -> dict[str, JobInfo]:
    """From the controller; without the jobs older than MinJobAge (alone: "Invalid job id specified")."""
    out: dict[str, JobInfo] = {}
    for chunk in _chunks(job_ids):
        text = _try(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(chunk), "-o", SQUEUE_FORMAT], asked)
        found = parse_squeue_many(text) if text is not None else {}
        out.update((job, found[job]) for job in chunk if job in found)
    return out


def sacct(job_id: str) -> JobInfo | None:
    return sacct_many([job_id]).get(job_id)


def squeue(job_id: str) -> JobInfo | None:
    return squeue_many([job_id]).get(job_id)


def scontrol(job_id: str, asked: _Asked | None = None) -> JobInfo | None:
    out = _try(["scontrol", "show", "job", job_id], asked)
    return parse_scontrol(out, job_id) if out is not None else None


def ask_many(job_ids: Iterable[str]) -> dict[str, JobInfo] | None:
    """Each job's best-known state (see the module docstring); a job Slurm does not know is left out.

    None when Slurm could not be asked at all (every command failed or timed out): unlike "Slurm does not know
    the job", that says nothing about whether a job is still running.
    """
    ids = list(dict.fromkeys(j for j in job_ids if j))
    if not ids:
        return {}
    asked = _Asked()
    acct = sacct_many(ids, asked)
    best = {job: info for job, info in acct.items() if info.terminal}
    rest = [job for job in ids if job not in best]
    live = squeue_many(rest, asked) if rest else {}
    for job in [j for j in rest if j not in live][:MAX_SCONTROL]:
        info = scontrol(job, asked)
        if info is not None:
            live[job] = info
    for job in rest:
        info = live.get(job) or acct.get(job)
        if info is not None:
            best[job] = info
    return best if asked.answered or best else None


def query_many(job_ids: Iterable[str]) -> dict[str, JobInfo]:
    """``ask_many``, with "cannot be asked" read as "knows none of them" (for views such as ``runner status``)."""
    return ask_many(job_ids) or {}


def query(job_id: str) -> JobInfo | None:
    """The job's best-known state: sacct's if final, else the controller's live one, else whatever sacct had."""
    return query_many([job_id]).get(job_id)


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


def time_left(job_id: str) -> float | None:
    """Seconds until the job's time limit (``squeue %L``); None when unlimited or Slurm cannot be asked."""
    out = proc.run(["squeue", "-h", "-j", job_id, "-o", "%L"], timeout=10, check=False)
    return parse_time_left(out.stdout) if out.returncode == 0 else None


REQUEUE_TIMEOUT_S = 10.0  # scontrol answers in well under a second; a hung controller must not eat the grace time


def requeue(job_id: str) -> str | None:
    """``scontrol requeue ID`` (from the job's own batch host: Slurm ends the job once it accepts); its complaint,
    or None when it accepted."""
    out = proc.run(["scontrol", "requeue", job_id], timeout=REQUEUE_TIMEOUT_S, check=False)
    return None if out.returncode == 0 else proc.last_line(out)


def delay_start(job_id: str, seconds: float) -> str | None:
    """Let a pending job start no earlier than ``seconds`` from now (a successor's backoff); scontrol's complaint,
    or None."""
    out = proc.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{max(1, round(seconds))}"],
                   timeout=QUERY_TIMEOUT_S, check=False)
    return None if out.returncode == 0 else proc.last_line(out)


def parse_version(text: str) -> tuple[int, int] | None:
    """``sbatch --version``'s answer (``slurm 22.05.8``, ``slurm-wlm 25.11.0``) as (major, minor); None when it
    says no version."""
    m = re.search(r"\bslurm(?:-wlm)?\s+(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else None


@functools.cache
def version() -> tuple[int, int] | None:
    """The site's Slurm version, from ``sbatch --version`` (asked once per process); None when it cannot be asked."""
    out = _try(["sbatch", "--version"])
    return None if out is None else parse_version(out)


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm hostlist (``n[1-3]``), in order; empty when scontrol cannot expand it. One plain name
    is its own list (no scontrol asked). scontrol is asked once per list and process (a hook asks several times)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", nodelist):
        return [nodelist]
    if not nodelist:
        return []
    if nodelist not in _EXPANDED:
        hosts = (_try(["scontrol", "show", "hostnames", nodelist]) or "").split()
        if not hosts:
            return []  # not remembered: scontrol may answer next time
        _EXPANDED[nodelist] = hosts
    return list(_EXPANDED[nodelist])


_EXPANDED: dict[str, list[str]] = {}  # hostnames' answers in this process


def partition_nodes(partition: str | None) -> list[str] | None:
    """The nodes of ``partition`` (None: Slurm's default partition, the one sinfo marks ``*``); None when Slurm
    cannot be asked or does not know the partition."""
    out = _try(["sinfo", "-h", "-N", "-o", "%N %P"])
    return None if out is None else parse_partition_nodes(out, partition)


def parse_partition_nodes(out: str, partition: str | None) -> list[str] | None:
    """``sinfo -h -N -o "%N %P"``'s lines (a node and one partition of it, ``*`` after the default's name) as the
    nodes of ``partition`` (None: the default one); None when it has none."""
    rows = [line.split() for line in out.splitlines()]
    found = sorted({row[0] for row in rows if len(row) == 2
                    and (row[1].rstrip("*") == partition if partition else row[1].endswith("*"))})
    return found or None


def slurmd_answers(node: str, timeout: float = 1.0) -> bool | None:
    """Whether ``node``'s slurmd accepts a connection (at its NodeAddr and port, as scontrol shows them): False for a
    node that is gone (power, a kernel panic, its slurmd killed) before Slurm's own SlurmdTimeout says so, True for
    one that only stopped beating (its ranks stopped: a hang); None when Slurm cannot say where it listens."""
    shown = _try(["scontrol", "show", "node", "-o", node]) or ""
    addr = re.search(r"\bNodeAddr=(\S+)", shown)
    port = re.search(r"\bPort=(\d+)", shown) or \
        re.search(r"^SlurmdPort\s*=\s*(\d+)", _try(["scontrol", "show", "config"]) or "", re.M)
    if addr is None or port is None:
        return None
    try:
        with socket.create_connection((addr.group(1), int(port.group(1))), timeout=timeout):
            return True
    except OSError:
        return False


def unhealthy(nodelist: str) -> list[str]:
    """The nodes of ``nodelist`` (a Slurm hostlist like ``n[1-3]``) that Slurm reports down, drained, failing or
    not responding: the ones a NODE_FAIL blames. Empty when Slurm cannot be asked."""
    hosts = hostnames(nodelist)
    bad = _try(["sinfo", "-h", "-N", "-t", "down,drain,fail,no_respond", "-o", "%N"])
    if not hosts or bad is None:
        return []
    return sorted(set(hosts) & set(bad.split()))
