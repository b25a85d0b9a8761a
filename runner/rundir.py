"""Every path of a run directory, and the only code that writes into one.

Both sides use it: the commands on the login node and the ranks inside the allocation share the run directory
on a shared filesystem. Writes are atomic (temp file, fsync, rename, fsync of the directory) so that a crash,
a kill or a full disk leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from runner import records, redaction
from runner.errors import RunnerError
from runner.ledger import EventName, Ledger, normalize
from runner.records import ExitStatus, LastExit, ProgramOutcome, RankExit, ResumeVerdict, RunManifest

log = logging.getLogger(__name__)


def atomic_write(path: Path, data: str | bytes | Callable[[IO[bytes]], None], mode: int = 0o666,
                 sync_dir: bool = True, scrub: bool = True, durable: bool = True) -> None:
    """Write a file so that readers see the old content or the new one, never a torn write.

    ``data`` may be a function that writes into the open file (a large object streamed, never held twice).
    ``mode`` (before the umask) holds from the first byte: 0o600 keeps a private file private all along.
    ``sync_dir=False`` leaves the directory's fsync to whoever moves the directory next (another process may
    rename it as soon as the file appears: a checkpoint's staging directory). ``durable=False`` skips every fsync:
    an advisory record rewritten every few seconds (``progress.json``), whole after a crash or missing, never torn.
    Text (a str, or bytes that are UTF-8 under 16 MiB) leaves without the webhook URLs this process knows
    (``runner.redaction``); ``scrub=False`` only for a private file (mode 0600) that must hold one.
    """
    if scrub and isinstance(data, str):
        data = redaction.scrub(data)
    elif scrub and isinstance(data, bytes) and len(data) < 16 << 20:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            if (clean := redaction.scrub(text)) != text:
                data = clean.encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    why: Unwritable | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync_dir and durable:
            fsync_dir(path.parent)
    except Exception as e:
        why = unwritable(path, e)  # before the half-written file goes: a full disk is still full
        if why is None:
            raise
    finally:
        with contextlib.suppress(OSError):  # a read-only folder: the error says so
            tmp.unlink(missing_ok=True)
    if why is not None:
        raise why from None


class Unwritable(RunnerError, OSError):
    """A run directory that cannot be written (read-only, not ours, a full disk): one line naming the file and the
    reason, still an OSError with the errno (a full disk's ENOSPC), however the writer reported it."""

    exit_code = 2

    def __str__(self) -> str:
        return str(self.args[0])  # the one line, not OSError's "[Errno N] ..."


def _full(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


def unwritable(path: Path, e: BaseException) -> Unwritable | None:
    """What a failed write of ``path`` means, as one line; None for what is not about the file system (a bug). A
    writer that hides ENOSPC behind its own words (torch.save's "unexpected pos") is told by the free space."""
    if isinstance(e, Unwritable):
        return e
    code = e.errno if isinstance(e, OSError) else None
    why = e.strerror if isinstance(e, OSError) else None
    if code != errno.ENOSPC and _full(path.parent):
        code, why = errno.ENOSPC, os.strerror(errno.ENOSPC)
    if not why:
        return None
    hint = "free some space on it" if code == errno.ENOSPC else "check the folder's owner and mode, and the mount"
    err = Unwritable(f"{path}: cannot write it: {why.lower()}; expected a run directory this user can write. "
                     f"hint: {hint}")
    err.errno, err.strerror, err.filename = code, why, str(path)
    return err


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path, blocking: bool = True, fail_open: bool = False) -> Iterator[bool]:
    """Hold an exclusive flock on ``path`` (created with its folder) for the with-block; the kernel drops it when
    the holder dies, so a killed process never leaves a stale lock. Yields whether this process holds it:
    ``blocking=False`` does not wait and yields False when another process holds it. ``fail_open=True`` goes on
    unlocked (yields True) where no lock can be taken at all: a read-only folder, a filesystem without locks."""
    with contextlib.ExitStack() as stack:
        held = True  # also where no lock can be had and fail_open goes on without one
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = stack.enter_context(open(path, "a"))
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            stack.callback(fcntl.flock, f, fcntl.LOCK_UN)  # also where a forked child shares the file
        except BlockingIOError:
            held = False
        except OSError:
            if not fail_open:
                raise
        yield held


def lock_held(path: Path) -> bool:
    """Whether a live process holds the flock on ``path`` (a shared lock taken and dropped at once to look); False
    where there is no such file or it cannot be looked at."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


MAX_RUN_FILE = 64 << 20  # a JSON record of a run directory (manifests, progress, chunks): never larger


class Unreadable(RunnerError):
    """A file that must not be opened or read whole: a FIFO, a device, a directory, or one over the size limit.

    ``found`` says what it is, ``hint`` what to do; the message is one line naming the file."""

    exit_code = 2

    def __init__(self, path: Path, found: str, hint: str, expected: str = "a regular file"):
        super().__init__(f"{path}: {found}; expected {expected}. hint: {hint}")
        self.found, self.hint = found, hint


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def read_regular(path: Path, limit: int = MAX_RUN_FILE) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. What is not a regular file is refused from its stat,
    before it is opened (reading a FIFO blocks until a writer comes, a device never ends); a file that grew or was
    swapped between the stat and the read is refused too.

    Raises:
        FileNotFoundError: it does not exist (callers treat that as missing).
        Unreadable: a special file, or larger than ``limit``.
        OSError: it cannot be read (permissions, I/O).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(path, f"found {_kind(st.st_mode)}", "remove it; runner writes only regular files here")
    if st.st_size > limit:
        raise Unreadable(path, f"found {st.st_size} bytes (over {limit})", "is this the file runner wrote?")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in since the stat never blocks
    with open(fd, "rb") as f:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise Unreadable(path, f"found {_kind(now.st_mode)}", "remove it; runner writes only regular files here")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unreadable(path, f"found over {limit} bytes", "is this the file runner wrote?")
    return data


def damaged(path: Path, why: str) -> None:
    """Say once per process, in one line, that a run file was skipped as if it were missing."""
    key = (str(path), why)
    if key not in _SAID:
        _SAID.add(key)
        log.warning("%s: %s; skipped as if it were missing", path, why)


_SAID: set[tuple[str, str]] = set()


def manifest_text(m: RunManifest) -> str:
    """A run's ``manifest.json`` as written: by ``RunDir.write_manifest``, and in a submission's plan (which writes
    nothing itself, and ``--dry-run`` prints)."""
    return json.dumps(m, indent=2) + "\n"


def number(record: Any, key: str, default: float = 0) -> Any:
    """``record[key]`` where it is a finite number (not a bool), else ``default``: a field of a JSON record read from a
    run directory, whatever shape a damaged file gave it (``{"step": null}``, ``"7"``, ``[1]``)."""
    value = record.get(key) if isinstance(record, dict) else None
    return value if records.is_number(value) else default


def read_json(path: Path, default: Any = None, shape: type | tuple[type, ...] = dict) -> Any:
    """A JSON record of a run directory, or ``default`` when it is missing or damaged: not a regular file, too large,
    not UTF-8 JSON, or not of ``shape`` (an object unless the caller says otherwise). A damaged file is named in one
    warning line and otherwise treated like a missing one."""
    try:
        data = json.loads(read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        return default
    except NotADirectoryError:
        return default
    except Unreadable as e:
        damaged(path, e.found)
        return default
    except OSError as e:
        damaged(path, f"cannot read it ({e.strerror or type(e).__name__})")
        return default
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        damaged(path, f"found no valid JSON ({type(e).__name__})")
        return default
    if not isinstance(data, shape):
        damaged(path, f"found a JSON {type(data).__name__}; expected "
                      f"{'an object' if shape is dict else 'another shape'}")
        return default
    return data


@dataclass(frozen=True)
class RunDir(Ledger):
    """Names every file of one run; see the README's "Run directory" section. Its ledger is written through
    ``record`` (``runner.ledger.Ledger``: the event names and the fields of each) and read through ``events``."""

    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def program_config(self, config_name: str) -> Path:
        """Program mode: the program's own config (``${program_config}``), under the config file's own name (ESPnet3
        names its experiment after it: ``exp_tag: ${self_name:}``)."""
        return self.root / "program" / config_name

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def manifest_record(self) -> RunManifest | None:
        """``manifest.json`` as its type (``runner.records``); None when missing or damaged (said in one line).
        ``runner.host.observe.manifest_of`` is the strict reader: a damaged manifest raises there."""
        raw = read_json(self.manifest)
        return None if raw is None else records.run_manifest(raw)

    def write_manifest(self, m: RunManifest) -> None:
        """Write ``manifest.json`` whole (atomically), as ``manifest_text`` renders it."""
        atomic_write(self.manifest, manifest_text(m))

    @property
    def script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def job_id_file(self) -> Path:
        return self.root / "job_id"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def exit_status(self) -> Path:
        return self.root / "exit_status.json"

    def exit_status_record(self) -> ExitStatus | None:
        """``exit_status.json`` as its type (``runner.records``); None when missing, damaged or without an exit code."""
        return records.exit_status(read_json(self.exit_status))

    def write_exit_status(self, status: ExitStatus) -> None:
        """Write ``exit_status.json`` whole (atomically: a reader sees the old record or the new one)."""
        atomic_write(self.exit_status, json.dumps(status) + "\n")

    @property
    def finished(self) -> Path:
        return self.root / "finished"

    @property
    def last_exit(self) -> Path:  # the launcher's own exit code (rank 0)
        return self.root / "last_exit.json"

    def last_exit_record(self) -> LastExit | None:
        """``last_exit.json`` as its type; None when missing, damaged or without a code."""
        return records.last_exit(read_json(self.last_exit))

    def write_last_exit(self, code: int, job_id: str | None, restart_count: str) -> None:
        record: LastExit = {"code": code, "job_id": job_id, "time": time.time(), "restart_count": restart_count}
        atomic_write(self.last_exit, json.dumps(record) + "\n")

    @property
    def cancelled(self) -> Path:  # written by `runner cancel`: never resubmit
        return self.root / "cancelled"

    @property
    def owner_lock(self) -> Path:  # a local run's lock, held (flock) by its driver and ranks while any of them lives
        return self.root / "owner.lock"

    @property
    def cancel_lock(self) -> Path:  # held (flock) by the `runner cancel` of a local run that is under way
        return self.root / "cancel.lock"

    @property
    def local_owner(self) -> Path:  # the processes of the local run that holds owner.lock (runner.host.local)
        return self.root / "owner.json"

    @property
    def successor(self) -> Path:  # resume.successor: the job queued behind the run's job ({"job_id", "after"})
        return self.root / "successor.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def resume_verdict(self) -> Path:  # rank 0's choice of checkpoint for the other ranks of its attempt
        return self.logs / ".resume-verdict.json"

    def resume_verdict_record(self) -> ResumeVerdict | None:
        return records.resume_verdict(read_json(self.resume_verdict, {}))

    def write_resume_verdict(self, verdict: ResumeVerdict) -> None:
        atomic_write(self.resume_verdict, json.dumps(verdict))

    @property
    def final(self) -> Path:
        return self.root / "final"

    def final_weights(self, rank: int) -> Path:  # one rank's weights after training: what a resumed run is compared by
        return self.final / f"rank-{rank:05d}.pt"

    @property
    def env_file(self) -> Path:
        return self.root / "env.json"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def preflight_table(self) -> Path:  # preflight.json as the plain-text table (``runner.checks.table``)
        return self.root / "preflight.txt"

    def preflight_rank(self, rank: int) -> Path:
        """What one rank measured in the preflight (its node's checks), gathered by rank 0."""
        return self.logs / "preflight" / f"rank-{rank:05d}.json"

    @property
    def progress(self) -> Path:  # the last step reached (rank 0, every few seconds; advisory)
        return self.root / "progress.json"

    @property
    def ranks(self) -> Path:  # the launcher's record of each rank (host, pid, attempt), written before training
        return self.root / "ranks"

    def rank_record(self, rank: int) -> Path:
        return self.ranks / f"rank-{rank:05d}.json"

    @property
    def exits(self) -> Path:  # one file per rank, written as its process ends (records.RankExit; the step reaper)
        return self.root / "exits"

    def rank_exit(self, rank: int) -> Path:
        return self.exits / f"rank-{rank:05d}.json"

    def write_rank_exit(self, rank: int, attempt: int | None, code: int) -> None:
        """Say this rank's process is ending; never fails the exit (a full or gone filesystem: the reaper waits for
        Slurm's word instead)."""
        mark: RankExit = {"rank": rank, "host": socket.gethostname(), "attempt": attempt, "code": code,
                          "time": time.time()}
        with contextlib.suppress(OSError):
            self.exits.mkdir(exist_ok=True)
            atomic_write(self.rank_exit(rank), json.dumps(mark) + "\n")

    def rank_exits(self, attempt: int) -> dict[int, RankExit]:
        """The ranks of ``attempt`` whose processes said they ended, by rank."""
        return {rank: mark for rank, p in RunDir.by_rank(self.exits).items()  # type: ignore[misc]
                if isinstance(mark := read_json(p), dict) and mark.get("attempt") == attempt}

    def rank_hosts(self, attempt: int) -> dict[int, str]:
        """The node of each rank of ``attempt``: from its heartbeat, else from the launcher's record of the rank
        (``ranks/rank-XXXXX.json``, written before training), so a rank stopped before its first heartbeat is named
        with its node too. Another attempt's files never name a node (its ranks may have run elsewhere)."""
        hosts: dict[int, str] = {}
        for folder, key in ((self.ranks, "hostname"), (self.heartbeats, "host")):
            for rank, p in RunDir.by_rank(folder).items():
                b = read_json(p)
                if isinstance(b, dict) and b.get("attempt") == attempt and b.get(key):
                    hosts[rank] = str(b[key])
        return hosts

    def rank_params(self, rank: int) -> Path:  # fsdp: the parameter elements one rank holds
        return self.ranks / f"params-rank{rank:05d}.json"

    @property
    def heartbeats(self) -> Path:  # one file per rank, rewritten while it trains (runner.job.watchdog)
        return self.root / "heartbeats"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank-{rank:05d}.json"

    @property
    def hang(self) -> Path:  # the last hang's summary: who stopped where (rank 0's watchdog)
        return self.root / "hang.json"

    def hang_reports(self, attempt: int) -> Path:
        """Each rank's own report of a hang in ``attempt`` (``rank-XXXXX.json``), summed up in ``hang``."""
        return self.root / "hangs" / f"{ATTEMPT_PREFIX}{attempt}"

    def hang_report(self, attempt: int, rank: int) -> Path:
        return self.hang_reports(attempt) / f"rank-{rank:05d}.json"

    def hang_request(self, attempt: int) -> Path:  # a rank that saw the hang asks every other rank for its report
        return self.hang_reports(attempt) / "requested"

    @staticmethod
    def by_rank(folder: Path) -> dict[int, Path]:
        """The ``rank-XXXXX.json`` files of a per-rank folder (``ranks``, ``heartbeats``, ``hang_reports``), by rank."""
        return {int(p.stem[5:]): p for p in folder.glob("rank-*.json") if p.stem[5:].isdigit()}

    @property
    def stragglers(self) -> Path:  # rank 0's latest comparison of the ranks' step times
        return self.root / "stragglers.json"

    @property
    def alerts(self) -> Path:  # the alerts' queue, what was sent and what the webhook refused (runner.alerts)
        return self.root / "alerts"

    @property
    def alert_queue(self) -> Path:  # undelivered alerts, one file each (runner.alerts.delivery)
        return self.alerts / "queue"

    @property
    def alerts_sent(self) -> Path:  # one line per delivered alert, redacted (runner report reads it)
        return self.alerts / "sent.jsonl"

    @property
    def alerts_rejected(self) -> Path:  # queued alerts that can never be delivered, set aside
        return self.alerts / "rejected"

    @property
    def git_diff(self) -> Path:  # the submitting checkout's uncommitted changes, mode 0600 (they may hold a token)
        return self.root / "git.diff"

    @property
    def secret_env(self) -> Path:  # export lines of the env: values that are secrets, mode 0600
        return self.root / SECRET_ENV

    @property
    def python(self) -> Path:  # program mode: a folder on the ranks' sys.path (runner's callback entry point)
        return self.root / "python"

    @property
    def parallel(self) -> Path:  # `runner parallel`: the chunks, results and driver (runner.parallel.store)
        return self.root / "parallel"

    @property
    def report_page(self) -> Path:  # `runner report`'s page of the run
        return self.root / REPORT_PAGE

    @property
    def console_log(self) -> Path:  # what a local run's driver says, when it runs in the background (API, sweep)
        return self.root / "console.log"

    def batch_log(self, job: str) -> Path:
        """Slurm's output of one job's batch script (every attempt of the job appends: --open-mode=append)."""
        return self.logs / f"slurm-{job}.out"

    def attempts(self) -> list[int]:
        """Attempt numbers that have a log folder (``logs/attempt-N``), oldest first."""
        found = [int(p.name.removeprefix(ATTEMPT_PREFIX)) for p in self.logs.glob(f"{ATTEMPT_PREFIX}*")
                 if p.name.removeprefix(ATTEMPT_PREFIX).isdigit()] if self.logs.is_dir() else []
        return sorted(found)

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"{ATTEMPT_PREFIX}{attempt}"

    def new_attempt(self, make_logs: bool = True) -> int:
        """Claim the next attempt number by creating its log folder (mkdir is atomic: two starters never share).

        The one place an attempt is claimed: a local run and ``runner parallel`` call it, the batch script through
        ``python -m runner.rundir attempt`` (``make_logs=False``: Slurm writes the job's output into ``logs/``, so a
        missing one means the run directory is gone or moved, and is never made again)."""
        n = (self.attempts() or [0])[-1] + 1
        while True:
            try:
                self.attempt_logs(n).mkdir(parents=make_logs)
                return n
            except FileExistsError:
                n += 1

    def rank_log(self, rank: int, attempt: int | None = None) -> Path:
        """One rank's log of one attempt (default: the latest attempt)."""
        if attempt is None:
            attempt = (self.attempts() or [1])[-1]
        return self.attempt_logs(attempt) / f"rank-{rank:05d}.log"

    # The stop signal's handshake. A rank that has not installed its handlers yet dies of the requeue signal
    # (SIGUSR2's default action), and Slurm's timer may send it seconds after the job starts. So whoever signals the
    # ranks writes the signal down first (``announce_signal``) and sends it only to ranks that said they are ready;
    # a rank says so after installing its handlers, then reads what was announced (``signal_ready``). Either the
    # signaller saw the rank ready (its handler was in place) or the rank sees the announcement.

    def signals(self, attempt: int) -> Path:  # the handshake's files of one attempt (beside its logs, not in them)
        return self.root / "signals" / f"{ATTEMPT_PREFIX}{attempt}"

    def pending_signal(self, attempt: int) -> Path:  # the stop signal's name, once it came for this attempt
        return self.signals(attempt) / "signal"

    def ready_file(self, attempt: int, rank: int) -> Path:  # this rank's signal handlers are installed
        return self.signals(attempt) / "ready" / f"rank-{rank:05d}"

    def announce_signal(self, attempt: int, signame: str) -> None:
        self.signals(attempt).mkdir(parents=True, exist_ok=True)
        atomic_write(self.pending_signal(attempt), signame + "\n", sync_dir=False)

    def signal_ready(self, attempt: int, rank: int) -> str | None:
        """Mark this rank ready for signals (its handlers installed); the signal announced before that, if any."""
        ready = self.ready_file(attempt, rank)
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.touch()
        try:
            return self.pending_signal(attempt).read_text().strip() or None
        except FileNotFoundError:
            return None

    def nonfinite_stop(self, attempt: int) -> Path:  # a plain program's rank saw a NaN/inf loss: every rank stops
        return self.signals(attempt) / "nonfinite"

    def nonfinite_seen(self, attempt: int, rank: int) -> Path:  # this rank is stopping for it (runner.steps)
        return self.signals(attempt) / "nonfinite-seen" / f"rank-{rank:05d}"

    def crash_file(self, attempt: int, rank: int) -> Path:
        """What one rank's training raised in one attempt (written by the launcher before it exits)."""
        return self.attempt_logs(attempt) / f"crash-{rank:05d}.json"

    def program_outcome(self, attempt: int, rank: int) -> Path:
        """What a program's fit did on one rank (``runner.records.ProgramOutcome``)."""
        return self.attempt_logs(attempt) / f"program-rank-{rank:05d}.json"

    def program_outcome_record(self, attempt: int, rank: int) -> ProgramOutcome | None:
        """None when no Trainer of the program carried runner's callback through a fit (or the file is damaged)."""
        return records.program_outcome(read_json(self.program_outcome(attempt, rank)))

    def write_program_outcome(self, attempt: int, rank: int, outcome: ProgramOutcome) -> None:
        atomic_write(self.program_outcome(attempt, rank), json.dumps(outcome))

    def crashes(self, attempt: int) -> dict[int, dict[str, Any]]:
        """Every crash record of ``attempt``, by rank."""
        return {int(p.stem.split("-")[1]): c for p in self.attempt_logs(attempt).glob("crash-*.json")
                if p.stem.split("-")[1].isdigit() and isinstance(c := read_json(p), dict)}

    def first_crash(self, attempt: int) -> dict[str, Any] | None:
        """The earliest exception any rank of ``attempt`` recorded: the cause; the others' are its echoes
        (a collective that lost a peer)."""
        found = [c for p in self.attempt_logs(attempt).glob("crash-*.json")
                 if isinstance(c := read_json(p), dict) and isinstance(c.get("time"), (int, float))]
        return min(found, key=lambda c: c["time"]) if found else None

    def job_id(self) -> str | None:
        try:
            text = read_regular(self.job_id_file, 256).decode("ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, Unreadable, ValueError) as e:
            damaged(self.job_id_file, getattr(e, "found", None) or type(e).__name__)
            return None
        if text and not text.replace("_", "").isdigit():  # a job id: digits (an array task: 12_3)
            damaged(self.job_id_file, f"found {text[:40]!r}; expected a Slurm job id")
            return None
        return text or None

    def _append(self, event: EventName, fields: Mapping[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        line = redaction.scrub(json.dumps({"time": round(time.time(), 3), "event": event, **fields}, sort_keys=True))
        # Never blocks: a FIFO in the ledger's place fails at once (ENXIO without a reader) or is refused below.
        try:
            fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
            with open(fd, "a") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise Unreadable(self.ledger, f"found {_kind(os.fstat(fd).st_mode)}", "remove it; runner writes "
                                     "only regular files here")
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if (why := unwritable(self.ledger, e)) is None:
                raise
            raise why from None

    def events(self) -> list[dict[str, Any]]:
        """The ledger, oldest first, each line in today's shape (``runner.ledger.normalize``); a torn or foreign
        line is skipped, never fatal."""
        try:
            lines = read_regular(self.ledger, MAX_LEDGER).decode("utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        except (OSError, Unreadable) as e:
            damaged(self.ledger, getattr(e, "found", None) or type(e).__name__)
            return []
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a torn last line after a crash (or a line nested past Python's depth) is skipped
            if isinstance(event, dict) and isinstance(event.get("event"), str) and _a_time(event.get("time")):
                out.append(normalize(event))  # anything else is not ours (a hand edit): skipped, never fatal
        return out


STANDBY_ENV = "RUNNER_STANDBY"  # a task of resume.in_job's warm standby step: its folder (runner.job.standby)


@dataclass(frozen=True)
class Standby:
    """The folder of one warm standby step of a job (resume.in_job, ``RUN/standby/JOB-N``): a file per task that
    waits (its node and local rank, written as it starts), and the begin hook's handoff (``records.StandbyHandoff``)."""

    folder: Path

    @property
    def handoff(self) -> Path:
        return self.folder / "handoff.json"

    def waiting(self, node: str, local: int, warm: bool = False) -> None:
        """Say this task waits (as it starts), or that it imported what a rank imports (``warm``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{'warm' if warm else 'here'}.{local}.{node}").touch()

    def present(self, warm: bool = False) -> set[tuple[str, int]]:
        """(node, local rank) of each task that said it waits (``warm``: that it imported, too)."""
        prefix = "warm." if warm else "here."
        try:
            names = [p.name.split(".", 2) for p in self.folder.iterdir() if p.name.startswith(prefix)]
        except OSError:
            return set()
        return {(n[2], int(n[1])) for n in names if len(n) == 3 and n[1].isdigit()}

    def hand_off(self, handoff: records.StandbyHandoff) -> None:
        atomic_write(self.handoff, json.dumps(handoff), durable=False)

    def handoff_record(self) -> records.StandbyHandoff | None:
        return records.standby_handoff(read_json(self.handoff)) if self.handoff.exists() else None


def _a_time(t: Any) -> bool:
    """A Unix time a ledger line can hold: a number a date can be made of (not NaN, not 1e308, not a bool)."""
    return records.is_number(t) and -1e11 < t < 1e11


MAX_LEDGER = 256 << 20  # a ledger of years of events stays far below
SECRET_ENV = "secret.env"  # RunDir.secret_env: a private file of the plan, sourced by the batch script
REPORT_PAGE = "report.html"  # RunDir.report_page; the run root's index links to RUN/report.html

# Each attempt (a submission, requeue or resubmission) logs into its own folder: logs/attempt-N/rank-XXXXX.log.
# Whoever starts the ranks of an attempt (the batch script, or `runner submit` locally) claims N and exports it.
ATTEMPT_PREFIX = "attempt-"
ATTEMPT_ENV = "RUNNER_ATTEMPT"
# A local run's owner lock (runner.host.local), open in every rank: its descriptor number, so that a program the rank
# starts as a child process holds the lock too, and the run stays owned while any process of it lives.
OWNER_FD_ENV = "RUNNER_OWNER_FD"
# Set (by sbatch's environment) only in a successor job (resume.successor): the job it follows.
SUCCESSOR_ENV = "RUNNER_SUCCESSOR_OF"

HEARTBEAT_S = 2.0  # each rank's watchdog rewrites its heartbeat this often (runner.job.watchdog; the step reaper)

# Exit codes of the launcher that the batch script and `runner cron` act on (Lightning exits 0 on SIGTERM,
# so "0" alone cannot tell a finished run from a stopped one; the `finished` marker can).
EXIT_REQUEUE = 75  # checkpointed after the requeue signal: requeue me
EXIT_TERMINATED = 76  # stopped (SIGTERM or early stop) before the end of training
EXIT_PREFLIGHT = 77  # a preflight check failed: training never started
EXIT_SUPERSEDED = 78  # another job owns the run now (its job_id): this one stopped without writing a checkpoint
EXIT_NONFINITE = 80  # the non-finite guard stopped training (a NaN/inf loss or gradient) before a checkpoint of it
EXIT_HANG = 79  # the hang watchdog stopped a job whose steps stopped advancing (hang.json says who, where)
EXIT_PROGRAM = 81  # program mode: the command cannot start, trains nothing, or trains another world size
EXIT_USAGE = 2  # the program refused its command line (argparse; python's "can't open file"): it would again
