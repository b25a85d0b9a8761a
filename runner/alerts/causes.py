"""Why a run stopped, read from its rank logs: the most likely root cause and the lines that show it.

Runs wherever an alert is made (the batch script's exit hook, ``runner cron``, a local run). Only the latest
attempt's logs (``logs/attempt-N/``, see ``runner.rundir``) are read, so an earlier attempt is never blamed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import stat
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from runner import slurmstates
from runner.alerts.nextstep import next_step
from runner.alerts.payload import Alert, clip
from runner.ledger import AlertEvent, CauseKind
from runner.rundir import EXIT_NONFINITE, EXIT_REQUEUE, EXIT_SUPERSEDED, EXIT_TERMINATED, RunDir

TAIL_LINES = 30  # log lines shown in an alert
_SCAN_BYTES = 256 * 1024  # of the end of each rank log: enough for a long traceback
_LINE_LIMIT = 500
_DETAIL_LIMIT = 300

_OOM_RE = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|OUT_OF_MEMORY|oom[-_ ]kill", re.I)
_NCCL_RE = re.compile(
    r"Watchdog caught collective operation timeout|NCCL error|NCCL communicator was aborted"
    r"|nccl(?:Unhandled\w*|System|Internal|Invalid\w*|Remote)Error"
)
_NODE_FAIL_RE = re.compile(r"NODE_FAIL|DUE TO NODE FAIL")
_TIME_LIMIT_RE = re.compile(r"DUE TO TIME LIMIT")
_PREEMPTED_RE = re.compile(r"DUE TO PREEMPTION|\bPREEMPTED\b")
# Output prefixes added by `srun --label` ("3: ") and torchrun ("[rank3]: ").
_PREFIX_RE = re.compile(r"^(?:\[(?:default)?rank\s*\d+\]:\s?|\d+:\s?)")
_EXC_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit)(?::\s|:$|$)")
_EXC_NAME_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::\s|:$|$)")
_PROGRAM_RE = re.compile(r"runner\.job\.\w+: program: (.*)")  # program mode: the command cannot train (exit 81)
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")

# Lower is a stronger sign that this rank's log shows the root cause.
_CAUSE_RANK: dict[CauseKind, int] = {
    "oom": 0,
    "node_failure": 1,
    "time_limit": 2,
    "preemption": 3,
    "nccl_timeout": 4,
    "exception": 5,
}


@dataclasses.dataclass(frozen=True)
class Cause:
    """Why an attempt ended, as data: what kind of end, and where (rank, node, step) with its evidence (``detail``:
    a log line, an exception, a report's summary). ``str()`` is the sentence alerts, status and the ledger show;
    nothing reads the sentence back."""

    kind: CauseKind
    detail: str = ""
    rank: int | None = None
    node: str = ""  # one node, or several joined by ", " (the preflight's failing nodes)
    step: int | None = None

    def __str__(self) -> str:
        at = "?" if self.step is None else self.step
        if self.kind == "exception":
            return f"Python exception: {self.detail}" + ("" if self.step is None else f", step {self.step}")
        if self.kind == "crash_loop":
            return f"crash_loop: {self.detail}" + ("" if self.step is None else f", step {at}") + \
                ", in two attempts in a row"
        if self.kind == "bad_nodes":
            return f"node: {self.node} failed the preflight: {self.detail}"
        if self.kind == "nan":
            return f"nan: non-finite {self.detail} at step {at}; training stopped before any checkpoint of it"
        if self.kind == "rank" or (self.kind == "oom" and self.rank is not None):
            return f"rank {self.rank}{f' on {self.node}' if self.node else ''}: {self.detail}"
        if self.kind in ("hang", "hook"):
            return self.detail
        if self.kind == "unknown":
            return "unknown"
        return f"{_LABELS[self.kind]}: {self.detail}"


# The sentence's head for the kinds found in a log (the words runner's alerts always used).
_LABELS: dict[CauseKind, str] = {"oom": "OOM", "node_failure": "node failure", "time_limit": "time limit",
                                 "preemption": "preemption", "nccl_timeout": "NCCL timeout", "program": "program"}


def crashed(crash: Mapping[str, Any], kind: Literal["exception", "crash_loop"] = "exception") -> Cause:
    """The cause a launcher's crash record names (``crash-XXXXX.json``): an exception raised at a frame, a step."""
    step = crash.get("step")
    return Cause(kind, f"{crash.get('type')}: {crash.get('message')} at {crash.get('frame')}",
                 step=step if isinstance(step, int) else None)


def _first_match(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    for line in lines:
        if pattern.search(line):
            return clip(line.strip(), _DETAIL_LIMIT)
    return None


def _exception_line(lines: list[str]) -> str | None:
    """The exception line of the last traceback, else the last `XxxError: msg` line."""
    stripped = [_PREFIX_RE.sub("", line.rstrip()) for line in lines]
    tb = max((i for i, s in enumerate(stripped) if "Traceback (most recent call last)" in s), default=-1)
    if tb >= 0:
        # Frames are indented; the exception is the first unindented `Name: message` after the
        # header, preferably one named like an exception (other ranks' output may be interleaved).
        after = [s for s in stripped[tb + 1 :] if s and not s[0].isspace()]
        for pattern in (_EXC_RE, _EXC_NAME_RE):
            for s in after:
                if pattern.match(s):
                    return clip(s, _DETAIL_LIMIT)
    for s in reversed(stripped):
        if _EXC_RE.match(s.strip()):
            return clip(s.strip(), _DETAIL_LIMIT)
    return None


def find_cause(log_lines: list[str], exit_code: int | None, slurm_state: str | None) -> Cause:
    """The most likely root cause: OOM, node failure, time limit, preemption, NCCL timeout, program (a command that
    cannot train), Python exception, or unknown.

    Why this order: an OOM on one rank makes the other ranks fail in NCCL, and a dead node or a
    Slurm kill (time limit, preemption) does the same, so those beat NCCL errors in the logs; a
    Slurm state or slurmstepd's "DUE TO ..." line is authoritative for how the job ended, and a
    Python traceback is usually the symptom of any of the above, so it comes last.
    """
    lines = [str(line) for line in log_lines]
    state = (slurm_state or "").strip().split(" ")[0].upper()

    oom = _first_match(_OOM_RE, lines)
    if oom or state == "OUT_OF_MEMORY":
        return Cause("oom", oom or "Slurm state OUT_OF_MEMORY")
    node = _first_match(_NODE_FAIL_RE, lines)
    if state == "NODE_FAIL" or node:
        return Cause("node_failure", node or "Slurm state NODE_FAIL")
    limit = _first_match(_TIME_LIMIT_RE, lines)
    if state == "TIMEOUT" or limit:
        return Cause("time_limit", limit or "Slurm state TIMEOUT")
    preempted = _first_match(_PREEMPTED_RE, lines)
    if state == "PREEMPTED" or preempted:
        return Cause("preemption", preempted or "Slurm state PREEMPTED")
    nccl = _first_match(_NCCL_RE, lines)
    if nccl:
        return Cause("nccl_timeout", nccl)
    program = next((m.group(1) for line in lines if (m := _PROGRAM_RE.search(line))), None)
    if program:
        return Cause("program", clip(program, _DETAIL_LIMIT))
    exc = _exception_line(lines)
    if exc:
        return Cause("exception", exc)
    return Cause("unknown")


def guess_cause(log_lines: list[str], exit_code: int | None, slurm_state: str | None) -> str:
    """``find_cause``'s sentence, as `"<kind>: <evidence>"` or `"unknown"`."""
    return str(find_cause(log_lines, exit_code, slurm_state))


def read_tail(path: Path) -> list[str]:
    """The last lines of a log, as a terminal would show them (progress-bar \\r rewrites collapsed)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open: no tail to read
            return []
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - _SCAN_BYTES))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").split("\n")
    if size > _SCAN_BYTES:
        lines = lines[1:]  # the first one is cut in the middle
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for line in lines:
        line = _ANSI_RE.sub("", line.rstrip("\r").rsplit("\r", 1)[-1])
        out.append(clip(line, _LINE_LIMIT))
    return out


def _trouble(lines: list[str]) -> int:
    """How strongly a log shows the root cause (lower is stronger); a log without trouble scores last."""
    kind = find_cause(lines, None, None).kind
    if kind in _CAUSE_RANK:
        return _CAUSE_RANK[kind]
    if any("Traceback" in ln or re.search(r"\berror\b", ln, re.I) for ln in lines):
        return len(_CAUSE_RANK)
    return len(_CAUSE_RANK) + 1


def pick_rank_log(rd: RunDir) -> tuple[Path | None, list[str]]:
    """The latest attempt's rank log that best shows what went wrong (lowest rank on ties), and its tail."""
    attempts = rd.attempts()
    if not attempts:
        return None, []
    logs = sorted(p for p in rd.attempt_logs(attempts[-1]).glob("rank-*.log") if p.is_file())
    if not logs:
        return None, []
    tails = [read_tail(p) for p in logs]
    best = min(range(len(logs)), key=lambda i: (_trouble(tails[i]), i))
    return logs[best], tails[best]


def alert_from_run(run_dir: str | os.PathLike[str], event: AlertEvent, **fields: Any) -> Alert:
    """An Alert for a run directory, its log tail and cause taken from the latest attempt's rank logs.

    The log with the strongest sign of failure (OOM > node failure > time limit > preemption > NCCL >
    traceback/error) wins, lowest rank on ties, rank 0 when none shows an error. Any Alert field may be
    given in `fields` and wins over what is found; `job_id` and `nodes` default to this job's (slurmstates.job_id) and
    $SLURM_JOB_NODELIST, `run` to the directory name, `cause` to find_cause()'s sentence and `cause_kind` to its
    kind (None for "completed"), `next_step` to ``nextstep.next_step(event)``. extra["log"] names the log used.
    """
    names = {f.name for f in dataclasses.fields(Alert)} - {"event", "run_dir"}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"alert_from_run() got unknown fields: {', '.join(unknown)}")
    root = Path(run_dir)
    log_path, lines = pick_rank_log(RunDir(root))
    values: dict[str, Any] = {
        "run": root.resolve().name,
        "job_id": slurmstates.job_id(os.environ) or "",
        "nodes": os.environ.get("SLURM_JOB_NODELIST", ""),
        "log_tail": lines[-TAIL_LINES:],
        "next_step": next_step(event),
    }
    values.update(fields)
    if "cause" not in fields and event != "completed":
        found = find_cause(lines, values.get("exit_code"), values.get("slurm_state"))
        values.update(cause=str(found), cause_kind=found.kind)
    extra = dict(values.get("extra") or {})
    if log_path is not None:
        extra.setdefault("log", str(log_path.relative_to(root)))
    values["extra"] = extra
    return Alert(event=event, run_dir=os.fspath(run_dir), **values)


# ---------------------------------------------------------------------------------------------------------------
# The first rank to fail: the cause, before its peers' echoes of it

# Exit codes of ranks that stopped in agreement with the others: never a failure.
ORDERLY = frozenset({0, EXIT_REQUEUE, EXIT_TERMINATED, EXIT_SUPERSEDED, EXIT_NONFINITE})
# What a rank raises when a peer died or left: an echo of the cause, never the cause.
_ECHO_RE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted"
                      r"|ProcessGroupGloo|DistBackendError|DistNetworkError|Socket Timeout|timed out|Timeout", re.I)
# srun's words for a task that ended badly: "srun: error: n2: task 3: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 1", "srun: error: n1: task 0: Out Of Memory".
_SRUN_RE = re.compile(r"srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How one rank ended, as whoever started it saw it (the local driver, or srun's output)."""

    rank: int
    code: int  # the exit code; negative: killed by that signal (subprocess's convention)
    time: float = 0.0  # when it was seen to end (order of srun's lines on Slurm)
    node: str = ""
    words: str = ""  # srun's own words ("Killed", "Out Of Memory"), when srun said it
    oom: bool = False  # killed by SIGKILL while the kernel's OOM killer ran (a local run: /proc/vmstat)

    @property
    def orderly(self) -> bool:
        return self.code in ORDERLY

    @property
    def how(self) -> str:
        if self.words:
            return self.words
        if self.code < 0:
            return f"killed by {_signame(-self.code)}"
        return f"exit {self.code}"


def _signame(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first rank that failed, its node and how; ``cause`` is the line the console, status and alerts show."""

    rank: int
    node: str
    how: str
    exit_code: int  # the attempt's exit code for it (a signal N as 128 + N, as a shell reports it)

    @property
    def why(self) -> Cause:
        return Cause("oom" if self.how.startswith("OOM") else "rank", self.how, rank=self.rank, node=self.node)

    @property
    def cause(self) -> str:
        return str(self.why)


def _echo(crash: Mapping[str, Any] | None) -> bool:
    return crash is not None and bool(_ECHO_RE.search(f"{crash.get('type')} {crash.get('message')}"))


def _killed(e: RankExit) -> bool:
    return e.code < 0 or bool(re.search(r"Killed|signal|Out Of Memory", e.words, re.I))


def _how(e: RankExit, crash: Mapping[str, Any] | None) -> str:
    if "out of memory" in e.words.lower():
        return f"OOM (srun: {e.words})"
    if e.oom:
        return "OOM (killed by SIGKILL as the kernel's OOM killer ran)"
    if _killed(e):
        return f"killed (srun: {e.words})" if e.words else f"killed by {_signame(-e.code)}"
    if crash and not _echo(crash):
        return str(crashed(crash))
    if crash:
        return f"{e.how} after {crash.get('type')}: {clip(str(crash.get('message')), 120)}"
    return e.how


def first_failure(exits: Iterable[RankExit], crashes: Mapping[int, Mapping[str, Any]],
                  killed: Collection[int] = ()) -> Failure | None:
    """The rank whose failure ended the attempt: the earliest one that was killed by a signal or raised an
    exception of its own, before any rank that only lost its peer (a "Connection closed by peer" is an echo).

    ``exits`` in the order they were seen; ``crashes`` the crash records by rank (``crash-XXXXX.json``); ``killed``
    the ranks that whoever started them killed after the failure (not a cause). None when no rank failed.
    """
    bad = [e for e in exits if not e.orderly and e.rank not in killed]
    if not bad:
        return None
    first = min(enumerate(bad), key=lambda ie: (not (_killed(ie[1]) or (ie[1].rank in crashes and
                                                                          not _echo(crashes[ie[1].rank]))), ie[0]))[1]
    code = 128 - first.code if first.code < 0 else first.code
    return Failure(first.rank, first.node, _how(first, crashes.get(first.rank)), code)


def srun_exits(lines: Sequence[str]) -> list[RankExit]:
    """The tasks srun reported as ended badly, in the order it reported them (``srun: error: n2: task 3: Killed``)."""
    out: list[RankExit] = []
    for i, line in enumerate(lines):
        m = _SRUN_RE.search(line)
        if m is None:
            continue
        how = m["how"]
        found = re.findall(r"exit code (\d+)", how)
        code = int(found[0]) if found else -signal.SIGKILL if re.search(r"Killed|Out Of Memory", how, re.I) else 1
        for part in m["tasks"].split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                continue
            for task in range(int(lo), int(hi or lo) + 1):
                out.append(RankExit(task, code, float(i), m["node"], how))
    return out
