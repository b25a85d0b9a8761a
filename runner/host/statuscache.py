"""``runner status``'s memory of each run's row, so that listing 10,000 runs reads only what changed.

A row is worked out from a handful of the run's files (the ledger, the manifest, the exit status, ``finished``, the job
id, the successor, the config, the checkpoints, the hang reports) and, for a local run, whether a process of it holds
its owner lock. The memory is one file in the runs root (``FILE``), a row per run with the stat of every file it was
read from (inode, size, modification and change time), taken before they were read. A row answers again only while:

- the file was written by this very code (runner's version and the stat of its modules: ``code``) in this format;
- every one of those stats is the same (a file appeared, went, grew or was replaced: read again);
- a local run whose state its liveness decides still has no live process (one that lives is read again);
- the row is whole and of this run (a damaged file, or a hand edit, is read again, never believed).

A run whose files changed within ``RACY_S`` is never remembered (a second write within the file system's time
resolution would leave the stat unchanged), nor a run whose state needs Slurm's answer, a running one or a ``runner
parallel`` run. The memory is written whole (``atomic_write``: a reader sees the old file or the new one); two
``status`` at once each write a file that is right, the later one wins. Where the root cannot be written (another
user's runs, a read-only mount) nothing is remembered. The wall time of a run that has not finished runs on to now:
its goodput is worked out again from the remembered attempts each time (``open``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import runner
from runner import checkpoint, goodput
from runner.rundir import ATTEMPT_PREFIX, RunDir, Unreadable, atomic_write, read_regular

log = logging.getLogger(__name__)

FILE = ".status-cache.json"
FORMAT = 1
RACY_S = 2.0  # a file changed this recently may change again within one tick of its clock: never remembered
MAX_BYTES = 256 << 20
_R = RunDir(Path("."))
# What a row is read from, relative to the run directory (RunDir names them); a missing one is remembered as missing.
WATCHED = tuple(str(p) for p in (_R.ledger, _R.manifest, _R.exit_status, _R.finished, _R.job_id_file, _R.successor,
                                 _R.config, _R.checkpoints, _R.hang_reports(1).parent))
# States that do not depend on whether a process of a local run lives (policy.local_run_state decides them first).
SETTLED = ("completed", "cancelled")
# The fields of an attempt that goodput.account reads (its `open` accounting is remembered in these).
_ACCOUNTED = ("number", "queued", "opener", "by", "started", "preflight_end", "preflight_s", "train_start",
              "lost_steps", "log_attempt", "ended", "outcome", "then", "finished")

Stat = list[int] | None


def code() -> str:
    """This code's identity: runner's version and the stat of every module of it (a checkout edited since, or
    another install, writes and reads its own memory)."""
    base = Path(runner.__file__).parent
    h = hashlib.sha256(f"{runner.__version__} {FORMAT}".encode())
    for dirpath, _, names in sorted(os.walk(base)):
        for name in sorted(n for n in names if n.endswith(".py")):
            st = os.stat(os.path.join(dirpath, name))
            h.update(f"{dirpath}/{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def stat_of(path: str) -> Stat:
    """The stat a row depends on; None for a file that is not there. Any other error raises (nothing remembered)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _inner(run: RunDir) -> list[str]:
    """The folders inside the watched ones whose changes a row depends on: the newest checkpoint (its COMPLETE
    marker comes after its folder's rename) and each attempt's hang reports (they come one by one)."""
    steps = checkpoint.CheckpointDir(run.checkpoints).steps()
    try:
        hangs = sorted(e.name for e in os.scandir(run.root / WATCHED[-1]) if e.name.startswith(ATTEMPT_PREFIX))
    except (FileNotFoundError, NotADirectoryError):
        hangs = []
    newest = [f"{WATCHED[-2]}/{max(steps)[1].name}"] if steps else []
    return newest + [f"{WATCHED[-1]}/{n}" for n in hangs]


def digest(stats: Sequence[Stat]) -> str:
    return hashlib.blake2b(repr(stats).encode(), digest_size=16).hexdigest()


@dataclass
class Signature:
    """The stats of what a run's row is read from, taken before it is read: ``paths`` relative to the run directory,
    the directory itself first (``.``: a file of ``WATCHED`` that appears changes it), then each of ``WATCHED`` that
    is there (one that is changed in place changes only itself), then the folders inside them (``_inner``)."""

    paths: list[str]
    stats: list[Stat]

    def racy(self, now: float) -> bool:
        return any(s is not None and s[2] > (now - RACY_S) * 1e9 for s in self.stats)


def signature(run: RunDir) -> Signature | None:
    """The run's signature now; None where a file cannot be looked at (its row is read, never remembered)."""
    root = f"{run.root}/"
    try:
        folder = stat_of(root + ".")
        there = [(p, st) for p in WATCHED if (st := stat_of(root + p)) is not None]
        inner = _inner(run)
        return Signature([".", *(p for p, _ in there), *inner],
                         [folder, *(st for _, st in there), *(stat_of(root + p) for p in inner)])
    except OSError:
        return None


def restat(run: RunDir, paths: Sequence[str]) -> list[Stat] | None:
    root = f"{run.root}/"
    try:
        return [stat_of(root + p) for p in paths]
    except OSError:
        return None


def open_json(acct: goodput.Accounting) -> dict[str, Any]:
    """An open accounting as JSON: the attempts' fields that ``goodput.account`` reads (``_ACCOUNTED``)."""
    return {"attempts": [{**{k: getattr(a, k) for k in _ACCOUNTED},
                          "hang": None if a.hang is None else float(a.hang["time"])} for a in acct.attempts],
            "created": acct.created, "kept": acct.kept, "kept_step": acct.kept_step,
            "stalls": sorted(acct.stalls.items()), "program": acct.program}


def open_of_json(d: Mapping[str, Any]) -> goodput.Accounting:
    attempts = [goodput.Attempt(**{k: a[k] for k in _ACCOUNTED},
                                hang=None if a["hang"] is None else {"time": a["hang"]}) for a in d["attempts"]]
    return goodput.Accounting(attempts, d["created"], d["kept"], d["kept_step"],
                              {int(k): float(v) for k, v in d["stalls"]}, bool(d["program"]))


def fresh(entry: Any, stats: Sequence[Stat] | None, alive: Callable[[], bool]) -> bool:
    """Whether a remembered row still answers (the rules in the module's docstring); ``stats``: its files' stats
    now (None: they cannot be looked at), ``alive``: whether a process of the run lives (asked only where the state
    depends on it)."""
    if not isinstance(entry, dict) or stats is None or entry.get("stats") != digest(stats):
        return False
    row = entry.get("row")
    if not isinstance(row, dict) or not isinstance(row.get("state"), str):
        return False
    return not entry.get("local") or row["state"] in SETTLED or not alive()


@dataclass
class Memory:
    """The rows remembered under one runs root, and what this look changed."""

    root: Path
    code: str
    entries: dict[str, Any] = field(default_factory=dict)
    changed: bool = False

    def row(self, run: RunDir, alive: Callable[[], bool], now: float) -> dict[str, Any] | None:
        """The run's remembered row with its age (and an open goodput) as of ``now``; None: read it."""
        entry: Any = self.entries.get(run.name)
        paths = entry.get("paths") if isinstance(entry, dict) else None
        if not isinstance(paths, list) or paths[:1] != ["."] or not all(isinstance(p, str) and _inside(p)
                                                                           for p in paths):
            return None
        if not fresh(entry, restat(run, paths), alive):
            return None
        try:
            row = dict(entry["row"])
            if row.get("run") != run.name or row.get("path") != str(run.root):
                return None
            created = entry["created"]
            row["age_s"] = round(now - (created if created is not None else now), 1)
            if entry["open"] is not None:
                row.update(open_of_json(entry["open"]).at(now).as_json())
            return row
        except Exception:  # a row of another shape (a hand edit): read the run again
            return None

    def keep(self, run: RunDir, sig: Signature | None, row: Mapping[str, Any], created: Any,
             open_: goodput.Accounting | None, local: bool, now: float) -> None:
        """Remember a row just read (``sig`` taken before reading it; ``created``: the manifest's, its age's start;
        ``open_``: its accounting where its wall time runs on to now), unless it may change without its files
        changing."""
        if sig is None or sig.racy(now) or row.get("state") == "running":
            self.changed |= self.entries.pop(run.name, None) is not None
            return
        self.entries[run.name] = {"paths": sig.paths, "stats": digest(sig.stats), "local": local,
                                  "created": created if isinstance(created, (int, float)) else None,
                                  "open": None if open_ is None else open_json(open_),
                                  "row": {k: v for k, v in row.items() if k != "age_s"}}
        self.changed = True

    def save(self, names: Sequence[str]) -> None:
        """Write the memory of the runs listed (``names``) where it changed; nothing where the root is read-only."""
        kept = {n: self.entries[n] for n in names if n in self.entries}
        if not self.changed and len(kept) == len(self.entries):
            return
        body = json.dumps(kept).encode()
        head = json.dumps({"format": FORMAT, "code": self.code, "sum": hashlib.blake2b(body).hexdigest()})
        try:
            atomic_write(self.root / FILE, head.encode() + b"\n" + body, durable=False)
        except OSError as e:  # a read-only root, another user's: nothing remembered
            log.debug("%s: status cache not written: %s", self.root, e)


def _inside(path: str) -> bool:
    """A path a signature may hold: the run directory, a watched file, or a folder inside a watched one."""
    head, _, name = path.partition("/")
    if not name:
        return path == "." or path in WATCHED
    return head in WATCHED[-2:] and "/" not in name and name not in (".", "..")


def load(root: Path) -> Memory:
    """The memory under ``root``: a line that says its format, the code that wrote it and the checksum of the rest,
    then the rows. Empty where there is none, or it is damaged, of another format or of other code."""
    memory = Memory(root, code())
    try:
        head, _, body = read_regular(root / FILE, MAX_BYTES).partition(b"\n")
        meta = json.loads(head)
        if not isinstance(meta, dict) or (meta.get("format"), meta.get("code")) != (FORMAT, memory.code) \
                or meta.get("sum") != hashlib.blake2b(body).hexdigest():
            return memory
        runs = json.loads(body)
    except FileNotFoundError:
        return memory
    except (OSError, Unreadable, ValueError, RecursionError) as e:  # damaged: as if there were none
        log.debug("%s: status cache not read: %s", root, e)
        return memory
    memory.entries = runs if isinstance(runs, dict) else {}
    return memory

