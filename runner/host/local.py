"""A local run (``scheduler: local``): its ranks on this machine, kept to the promises of a Slurm run.

- **One trainer per run directory.** The driver (``runner submit``/``resume``, in the foreground) takes an exclusive
  flock on ``RUN/owner.lock`` before any rank starts and hands the open lock to every rank, so the lock lives as long
  as any process of the run does, and the kernel drops it when the last one dies: a lock left by a killed run is no
  lock at all (the next driver takes it over, and says so). ``owner.json`` names the processes, for ``cancel`` and
  for the refusal's message. ``status`` and ``logs --follow`` ask the lock whether the run is alive.
- **A failed rank ends the attempt**, as ``srun --kill-on-bad-exit`` does: when a rank exits with a failure (an
  exception, a signal, a hang's exit 79), the ranks still running ``KILL_WAIT_S`` later are killed (a SIGSTOPped or
  hung rank never exits by itself, and a rank that lost its peer would wait ``network.pg_timeout_s``).
- **Signals.** The first Ctrl-C (or SIGTERM, SIGUSR2) stops the ranks at an agreed step with a checkpoint; a second
  Ctrl-C or SIGTERM kills them at once. A Ctrl-C is recorded as ``interrupted`` (a person stopped it), SIGTERM and
  SIGUSR2 as ``preempted``.
- **The end** is recorded with its outcome and its cause: the first rank that failed, and how
  (``runner.alerts.causes.first_failure``), shown on the console, in ``runner status`` and in the alert.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import alerts, ledger, policy, redaction, world
from runner.alerts import nextstep
from runner.alerts.causes import RankExit, first_failure
from runner.errors import SubmitError
from runner.host import ending
from runner.rundir import OWNER_FD_ENV, RunDir, atomic_write, lock_held, read_json
from runner.spec.typed import read_resolved

log = logging.getLogger(__name__)
KILL_WAIT_S = 5.0  # after a rank failed, how long the others get to exit by themselves (Slurm's KillWait)
CANCEL_WAIT_S = 30.0  # `runner cancel`: how long the ranks get to checkpoint and exit before they are killed
DRIVER_WAIT_S = 10.0  # `runner cancel`: how long the driver gets to record the end once its ranks are killed
READER_WAIT_S = 2.0  # how long a starter waits out a lock held by no live run's process (a reader's look)


# ---------------------------------------------------------------------------------------------------------------
# The owner lock


@dataclass
class Owner:
    """The held lock of one local run: an open descriptor with an exclusive flock, inherited by every rank."""

    run: RunDir
    fd: int
    took_over: dict[str, Any] | None = None  # the owner.json of a run that died without ending, taken over

    def describe(self, pids: list[int], attempt: int | None) -> None:
        atomic_write(self.run.local_owner, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                       "ranks": pids, "attempt": attempt,
                                                       "started": time.time()}) + "\n")

    def close(self, ended: bool = True) -> None:
        """Let go of this process's share of the lock (ranks still alive keep it); mark owner.json ended."""
        if ended:
            who = read_json(self.run.local_owner, {})
            if isinstance(who, dict) and who.get("pid") == os.getpid():
                atomic_write(self.run.local_owner, json.dumps({**who, "ended": time.time()}) + "\n")
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _who(owner: object) -> str:
    if not isinstance(owner, dict):
        return "its processes hold the lock"
    ranks: list[Any] = owner["ranks"] if isinstance(owner.get("ranks"), list) else []
    return (f"runner pid {owner.get('pid')} on {owner.get('host')}, attempt {owner.get('attempt')}, "
            f"ranks {', '.join(map(str, ranks)) or '-'}")


def _pids(owner: object) -> list[int]:
    """The processes a local run's owner.json names on this host (none for another host's run)."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return []
    ranks: list[Any] = owner["ranks"] if isinstance(owner.get("ranks"), list) else []
    return [p for p in [owner.get("pid"), *ranks] if isinstance(p, int) and p > 0]


def acquire(run: RunDir) -> Owner:
    """Take the run's owner lock, or refuse: one trainer per run directory.

    A lock whose holders died is free (the kernel dropped it): it is taken over, and the warning names the run that
    died. A moment's hold by a reader (``held`` takes a shared lock to look) is waited out.

    Raises:
        SubmitError: a live local run holds it.
    """
    run.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(run.owner_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + READER_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            owner = read_json(run.local_owner)
            live = not _pids(owner) or any(_alive(p) for p in _pids(owner))
            if live or time.monotonic() > deadline:  # else a reader's shared hold, released at once
                os.close(fd)
                raise SubmitError(f"run {run.name} is training on this machine now ({_who(owner)}): one trainer per "
                                  f"run directory. hint: `runner cancel {run.name}` first, or let it end") from None
            time.sleep(0.01)
        except OSError as e:  # a filesystem without locks: go on, as one would without the check
            log.warning("%s: cannot lock (%s); not checking for another trainer", run.owner_lock, e.strerror)
            break
    previous = read_json(run.local_owner)
    stale = previous if isinstance(previous, dict) and "ended" not in previous else None
    if stale is not None:
        log.warning("run %s: taking over from a local run that died without ending (%s)", run.name, _who(stale))
    owner = Owner(run, fd, stale)
    owner.describe([], None)  # at once: a second starter reads who holds the lock, not the last run's record
    return owner


def held(run: RunDir) -> bool:
    """Whether a live local run holds the run's owner lock."""
    return lock_held(run.owner_lock)


def _wait_free(run: RunDir, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while held(run):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def cancel(run: RunDir, wait_s: float = CANCEL_WAIT_S, starting: Callable[[], None] = lambda: None) -> str:
    """Stop a live local run's processes: SIGTERM (the ranks checkpoint at an agreed step and exit), then SIGKILL for
    what is left after ``wait_s``; returns what happened, once the processes are gone (the lock is free).
    ``starting`` is called once this cancel is the one that stops them (it holds the cancel lock), before SIGTERM."""
    if not held(run):
        return "no local process of it was running"
    owner = read_json(run.local_owner)
    pids = _pids(owner)
    if not pids:
        host = owner.get("host") if isinstance(owner, dict) else None
        return f"its processes run on {host or 'another host'}: stop them there"
    with _cancel_under_way(run) as mine:
        if not mine:  # a second SIGTERM would be the driver's "stop at once": wait for the first cancel instead
            start = time.monotonic()
            if _wait_free(run, wait_s + 15):
                return f"stopped by the cancel already under way, {time.monotonic() - start:.1f} s later"
            return "a cancel is under way and its processes have not stopped yet: see `runner status`"
        starting()
        return _stop(run, pids, wait_s)


@contextlib.contextmanager
def _cancel_under_way(run: RunDir) -> Iterator[bool]:
    """Whether this cancel is the run's only one (it holds ``cancel_lock`` until it returns)."""
    try:
        fd = os.open(run.cancel_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:
            pass  # a filesystem without locks: as before, no check
        yield True
    finally:
        os.close(fd)


def _stop(run: RunDir, pids: list[int], wait_s: float) -> str:
    """SIGTERM (the driver forwards it; the ranks checkpoint and exit), then SIGKILL for what is left after wait_s."""
    start = time.monotonic()
    driver, ranks = pids[0], pids[1:]
    for pid in [driver] if _alive(driver) else ranks:  # the driver forwards it to every rank, and records the end
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    if _wait_free(run, wait_s):
        return f"its {len(ranks)} local processes stopped {time.monotonic() - start:.1f} s after SIGTERM"
    for pid in ranks:
        _kill_group(pid)
    if not _wait_free(run, DRIVER_WAIT_S):  # the driver records the attempt's end (its exit) once its ranks are gone
        with contextlib.suppress(OSError):
            os.kill(driver, signal.SIGKILL)
    gone = _wait_free(run, 10)
    return (f"its {len(ranks)} local processes did not stop within {wait_s:.0f} s of SIGTERM: killed, "
            f"{'gone' if gone else 'still holding the lock'} {time.monotonic() - start:.1f} s after SIGTERM")


def _kill_group(pid: int) -> None:
    """SIGKILL a rank and what it started (its own session: data loader workers, a program's process)."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------------------
# The driver


@dataclass
class _Attempt:
    """What the driver saw of one attempt: exits in the order they came, and how it was asked to stop."""

    procs: list[subprocess.Popen[bytes]]
    run_dir: RunDir
    attempt: int
    exits: list[RankExit] = field(default_factory=list)
    stop: str | None = None  # interrupted (Ctrl-C) or preempted (SIGTERM, SIGUSR2)
    killed_by_us: set[int] = field(default_factory=set)  # ranks this driver killed (not a cause)

    def forward(self, signum: int) -> None:
        """To every rank ready for it; a rank not ready yet reads it when it is (``RunDir.announce_signal``)."""
        with contextlib.suppress(OSError):
            self.run_dir.announce_signal(self.attempt, signal.Signals(signum).name.removeprefix("SIG"))
        for rank, p in enumerate(self.procs):
            if self.run_dir.ready_file(self.attempt, rank).exists():
                with contextlib.suppress(OSError):
                    p.send_signal(signum)

    def kill_rest(self, why: str) -> None:
        done = {e.rank for e in self.exits}
        rest = [r for r, p in enumerate(self.procs) if r not in done and p.poll() is None]
        if rest:
            log.warning("%s: killing rank%s %s", why, "s" if len(rest) > 1 else "", ", ".join(map(str, rest)))
        for r in rest:
            self.killed_by_us.add(r)
            _kill_group(self.procs[r].pid)


def _start(run: RunDir, world_size: int, per_node: int, attempt: int, owner: Owner) -> list[subprocess.Popen[bytes]]:
    cfg = read_resolved(run.config)
    with socket.socket() as s, socket.socket() as s2:  # two free ports: Lightning's and preflight's
        s.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        at = world.Rendezvous("127.0.0.1", s.getsockname()[1], s2.getsockname()[1])
    procs = []
    secret = redaction.webhook_names(cfg)
    inherited = {k: v for k, v in os.environ.items() if k not in secret}
    for rank in range(world_size):
        place = world.rank_env(rank, rank % per_node, rank // per_node, world_size, per_node, attempt=attempt,
                               max_restarts=cfg["resume"]["max_restarts"], run_id=run.name, inherited=inherited)
        env = {**inherited, **world.attempt_env(run.root, attempt, at), **place,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), OWNER_FD_ENV: str(owner.fd)}
        for key in [k for k in env if k.startswith("SLURM_")]:
            del env[key]
        env.update({k: str(v) for k, v in cfg.get("env", {}).items()})
        env.update(redaction.secret_env_items(run.secret_env))  # config.yaml holds these redacted
        # Own session: a Ctrl-C at the terminal reaches only the driver, which turns it into a checkpoint. The lock's
        # descriptor is inherited: the run stays locked while any rank lives, even if the driver is killed.
        # stdin from /dev/null, as srun gives a batch job's tasks: a program that reads it ends instead of waiting.
        procs.append(subprocess.Popen([sys.executable, "-m", "runner.job.launch", str(run.root)], env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(owner.fd,)))
    return procs


def _handle_signals(att: _Attempt, requeue_signal: int) -> dict[int, Any]:
    """Install the driver's handlers (before any rank starts: a Ctrl-C must never find Python's default); returns
    the previous ones. First Ctrl-C/TERM/USR2: every rank checkpoints at an agreed step and exits; a second Ctrl-C or
    TERM kills them at once."""
    signals: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        if len([s for s in signals if s != signal.SIGUSR2]) >= 2 and signum != signal.SIGUSR2:
            print("stopping at once: killing the ranks", file=sys.stderr, flush=True)
            att.kill_rest("a second Ctrl-C")
            return
        att.stop = att.stop or ("interrupted" if signum == signal.SIGINT else "preempted")
        if signum == signal.SIGINT:
            print("\nstopping: the ranks checkpoint at the next step (Ctrl-C again to stop at once)", file=sys.stderr,
                  flush=True)
        att.forward(requeue_signal)

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}


class Progress:
    """Live progress of a local run on the terminal, from rank 0's ``progress.json`` (step, loss, every 2 s): a bar
    rewritten in place on a terminal, a line every ``LINE_S`` otherwise (a log, a pipe)."""

    LINE_S = 10.0
    WIDTH = 24

    def __init__(self, run: RunDir, attempt: int, max_steps: int, tty: bool | None = None) -> None:
        self.run, self.attempt, self.max_steps = run, attempt, max_steps
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.first: tuple[int, float] | None = None  # (step, time) of this attempt's first record
        self.shown: tuple[int, float] | None = None
        self.printed_at = time.monotonic()
        self.bar = False

    def line(self, p: dict[str, Any]) -> str:
        step, now = int(p["step"]), float(p["time"])
        assert self.first is not None
        rate = (step - self.first[0]) / (now - self.first[1]) if now > self.first[1] else 0.0
        total = self.max_steps if self.max_steps > 0 else None
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        if total and self.tty:
            done = min(1.0, step / total)
            parts.append("[" + "#" * round(done * self.WIDTH) + "." * (self.WIDTH - round(done * self.WIDTH)) +
                         f"] {done:.0%}")
        elif total:
            parts[0] += f" ({min(1.0, step / total):.0%})"
        if isinstance(p.get("loss"), (int, float)):
            parts.append(f"loss {p['loss']:.4g}")
        if rate > 0:
            parts.append(f"{rate:.1f} steps/s")
            if total and step < total:
                parts.append(f"ETA {_duration((total - step) / rate)}")
        return "  ".join(parts)

    def __call__(self) -> None:
        p = read_json(self.run.progress)
        if not isinstance(p, dict) or p.get("attempt") != self.attempt or not isinstance(p.get("step"), int) or \
                not isinstance(p.get("time"), (int, float)):
            return
        if self.first is None:
            self.first = (p["step"], p["time"])
        if self.shown == (p["step"], p["time"]):
            return
        if self.tty:
            print(f"\r\033[K{self.line(p)}", end="", file=sys.stderr, flush=True)
            self.bar, self.shown = True, (p["step"], p["time"])
        elif time.monotonic() - self.printed_at >= self.LINE_S:
            print(self.line(p), file=sys.stderr, flush=True)
            self.printed_at, self.shown = time.monotonic(), (p["step"], p["time"])

    def close(self) -> None:
        if self.bar:
            print(file=sys.stderr, flush=True)  # the bar's line stays; what follows starts below it
            self.bar = False


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}" \
        if s >= 60 else f"{s}s"


def oom_kills(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """How many processes the kernel's OOM killer has killed on this machine since boot (``oom_kill``, Linux >= 4.13;
    a memory cgroup's limit counts too), or None where it cannot be read. A rank killed by SIGKILL while it grew is
    named as an OOM, not a bare SIGKILL (srun says "Out Of Memory" itself on Slurm)."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _supervise(att: _Attempt, progress: Callable[[], None] = lambda: None) -> None:
    """Wait for every rank, acting on the first failure (``KILL_WAIT_S``, then kill the rest); shows ``progress``
    about every second."""
    done: queue.Queue[RankExit] = queue.Queue()

    ooms = oom_kills()

    def waiter(rank: int, p: subprocess.Popen[bytes]) -> None:
        code = p.wait()
        with contextlib.suppress(OSError):  # what the rank started dies with it (a program's child, its children)
            os.killpg(p.pid, signal.SIGKILL)  # the launcher led its own session: its group outlives it
        oom = code == -signal.SIGKILL and ooms is not None and (oom_kills() or 0) > ooms
        done.put(RankExit(rank=rank, code=code, time=time.time(), node=socket.gethostname(), oom=oom))

    for rank, p in enumerate(att.procs):
        threading.Thread(target=waiter, args=(rank, p), daemon=True, name=f"rank-{rank}").start()
    deadline: float | None = None
    while len(att.exits) < len(att.procs):
        progress()
        wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        try:
            ex = done.get(timeout=wait)
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline:
                first = next(e for e in att.exits if not e.orderly)
                att.kill_rest(f"rank {first.rank} failed ({first.how}) {KILL_WAIT_S:.0f} s ago")
                deadline = float("inf")
            continue
        att.exits.append(ex)
        if not ex.orderly and deadline is None and ex.rank not in att.killed_by_us:
            deadline = time.monotonic() + KILL_WAIT_S


def outcome(rec: policy.Records, rc: int, stop: str | None, limits: policy.Limits) -> ledger.Outcome:
    """What the attempt's end means: a person's Ctrl-C is ``interrupted``, the rest as the exit hook decides."""
    event = policy.classify(rec, rc, None, limits)
    if stop == "interrupted" and event in ("preempted", "failed"):
        return "interrupted"
    return event


def run(run_dir: RunDir, world_size: int, owner: Owner, num_device: int | None = None) -> int:
    """Start one launcher process per rank on this machine and wait for the attempt's end; record it and alert.

    Each call is a new attempt with its own log folder, claimed here and handed to the ranks. ``owner`` is the held
    lock (``acquire``); it is let go when every rank has ended.
    """
    cfg = read_resolved(run_dir.config)
    attempt = run_dir.new_attempt()
    att = _Attempt([], run_dir, attempt)
    requeue_signal = getattr(signal, f"SIG{cfg['slurm']['signal']}")
    old = _handle_signals(att, requeue_signal)
    try:
        att.procs = _start(run_dir, world_size, num_device or cfg["num_device"], attempt, owner)
        if att.stop:  # a Ctrl-C while they were starting: they stop at their first step
            att.forward(requeue_signal)
        owner.describe([p.pid for p in att.procs], attempt)
        print(f"run {run_dir.root}: {world_size} local processes, logs in {run_dir.attempt_logs(attempt)}/", flush=True)
        shown = Progress(run_dir, attempt, cfg["trainer"]["max_steps"])
        try:
            _supervise(att, shown)
        finally:
            shown.close()
        return _record_end(run_dir, cfg, att, attempt)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        owner.close()


def _record_end(run_dir: RunDir, cfg: Any, att: _Attempt, attempt: int) -> int:
    codes = [next(e.code for e in att.exits if e.rank == r) for r in range(len(att.procs))]
    failure = first_failure(att.exits, run_dir.crashes(attempt), att.killed_by_us)
    rc = failure.exit_code if failure else next((128 - c if c < 0 else c for c in codes if c != 0), 0)  # 137: KILL
    rec = policy.Records(events=run_dir.events(), exit_status=run_dir.exit_status_record(),
                         finished=run_dir.finished.exists())
    event = outcome(rec, rc, att.stop, policy.Limits.of(cfg))
    why = ending.why(run_dir, event, attempt, rec.events, att.exits, att.killed_by_us)
    ending.record(run_dir, cfg["alerts"], {"exit_code": rc, "codes": codes, "outcome": event, "attempt": attempt,
                                           "cause": why.sentence, "crash": why.crash, "scheduler": "local"})
    _console(run_dir, event, rc, why.sentence, why.rank or 0, attempt)
    if event in LOCAL_ALERTS and ledger.is_alert_event(event):
        alerts.notify(run_dir.root, cfg["alerts"], event, job_id="", attempt=attempt, nodes=socket.gethostname(),
                      exit_code=rc, next_step=_next(run_dir, event, rc),
                      **ending.alert_fields(run_dir, why, attempt))
    return rc


LOCAL_ALERTS = ("failed", "hang", "nan", "preflight_failed", "completed")  # a person's stop is no news to them


def _console(run_dir: RunDir, event: str, rc: int, cause: str | None, rank: int, attempt: int) -> None:
    """The end on the terminal: the failing rank's last lines (not rank 0's echo of it), the cause, what next."""
    if event not in ("completed", "interrupted", "preempted", "cancelled"):
        try:
            lines = run_dir.rank_log(rank, attempt).read_text(errors="replace").splitlines()[-8:]
        except OSError:
            lines = []
        if lines:
            print(f"last lines of rank {rank} ({run_dir.rank_log(rank, attempt)}):")
        for line in lines:  # what the program printed: without any secret this process knows (runner.redaction)
            print(f"  {redaction.scrub(line)}")
    if event == "completed":
        print(f"run {run_dir.root}: finished")
        return
    print(f"run {run_dir.root}: {event} (exit {rc})" + (f": {redaction.scrub(cause)}" if cause else ""))
    print(f"next: {_next(run_dir, event, rc)}")


def _next(run_dir: RunDir, event: str, rc: int) -> str:
    """The next-step line of a local attempt's end, knowing whether runner holds a complete checkpoint of the run."""
    from runner.checkpoint import complete

    return nextstep.next_step(event, by="local", run=run_dir.name, exit_code=rc,
                              saved=bool(complete(run_dir.checkpoints, force=True)))
