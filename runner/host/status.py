"""Read the state of runs: the run directory's own records first, the scheduler second.

What a run's state is follows from those facts by ``runner.policy``; this module only shows them. Each run is
looked at once (``runner.host.observe``), Slurm is asked once for all the runs listed, and a run whose files cannot
be read becomes one row that says what is wrong, never an error that hides the other runs.
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runner import checkpoint, goodput, policy, redaction, slurmstates, stragglers
from runner import log as runner_log
from runner.errors import InputError, RunnerError
from runner.host import local, observe, scheduler, statuscache
from runner.records import RunManifest
from runner.rundir import RunDir, read_json

log = logging.getLogger(__name__)
DEFAULT_URL_ENV = redaction.DEFAULT_URL_ENV  # alerts.url_env's default


_STAMPED = re.compile(r"(?P<name>.+)-(?P<stamp>\d{8}-\d{6})(?:-(?P<n>\d+))?")


def _run_name(entry: str) -> tuple[str, tuple[str, int]]:
    """A run directory's run name and its place in time: ``NAME-YYYYmmdd-HHMMSS[-N]`` (``runner submit``'s
    names; N counts submits of one name within one second)."""
    m = _STAMPED.fullmatch(entry)
    if m is None:
        return entry, ("", 0)
    return m["name"], (m["stamp"], int(m["n"] or 1))


def _is_run(path: Path) -> bool:
    try:
        return stat.S_ISREG(RunDir(path).config.stat().st_mode)
    except (OSError, ValueError):  # missing, unreadable, a name the OS refuses: not a run here
        return False


def find_run(name: str, root: Path) -> RunDir:
    """A run by path, by directory name under root, or by run name (or a prefix of one): the newest match.

    Raises:
        InputError: no run matches, or a prefix matches runs of several names (the message lists them).
    """
    if "\0" in name or not name:
        raise InputError(f"run {name!r}: found no run directory; expected a path or a run name. hint: "
                          "`runner status` lists runs")
    for cand in (Path(name), root / name):
        if _is_run(cand):
            return RunDir(cand.resolve())
    entries: list[str] = []
    if "/" not in name:  # a path that is not a run is never a prefix
        try:
            entries = [e.name for e in os.scandir(root) if e.name.startswith(name)]
        except OSError:
            entries = []
    matches = [e for e in entries if _is_run(root / e)]
    if not matches:
        raise InputError(f"run {name!r}: found no run directory under {root}/; expected a path or a run name. "
                          "hint: `runner status` lists runs")
    by_name: dict[str, list[str]] = {}
    for entry in matches:
        by_name.setdefault(_run_name(entry)[0], []).append(entry)
    chosen = by_name.get(name)
    if chosen is None and len(by_name) > 1:
        newest = sorted(max(group, key=lambda e: _run_name(e)[1]) for group in by_name.values())
        raise InputError(f"run {name!r}: found runs of {len(by_name)} names under {root}/ ({', '.join(newest[:10])}"
                          f"{', ...' if len(newest) > 10 else ''}); expected one. hint: give more of the name, or "
                          "the directory")
    group = chosen if chosen is not None else next(iter(by_name.values()))
    return RunDir((root / max(group, key=lambda e: (_run_name(e)[1], e))).resolve())


def row(run: RunDir, jobs: Mapping[str, slurmstates.JobInfo] | None = None) -> dict[str, Any]:
    """One run's status; ``jobs`` is Slurm's answer for many runs at once (asked here when not given)."""
    return row_of(observe.observe(run, observe.shown, jobs, strict=True))


def row_of(seen: observe.Observation, last: tuple[int, Path] | None | Literal["find"] = "find") -> dict[str, Any]:
    """The status of a run looked at already (``observe.shown``); ``last``: its newest complete checkpoint where
    the caller found it already (``runner report`` reads every manifest)."""
    return _row(seen, last)[0]


def _row(seen: observe.Observation, last: tuple[int, Path] | None | Literal["find"] = "find") \
        -> tuple[dict[str, Any], goodput.Accounting, float | None]:
    """The row, with what its goodput is worked out from and the end of its wall time (``_accounting``)."""
    run, manifest, rec, info, heir = seen.run, seen.manifest, seen.records, seen.job, seen.heir
    cfg_hash = manifest.get("config_hash")
    if last == "find":
        last = checkpoint.latest(run.checkpoints, cfg_hash) if run.checkpoints.is_dir() else None
    events = list(rec.events)
    state = policy.run_state(rec, info, heir) if _is_parallel(manifest) else \
        scheduler.of_manifest(manifest).state(run, rec, info, heir)
    acct, end = _accounting(run, seen.attempts, manifest, last)
    return {"run": run.name, "path": str(run.root), "state": state, "job_id": rec.job_id,
            "last_checkpoint_step": last[0] if last else None,
            "restarts": policy.restarts_used(events),
            "age_s": round(time.time() - manifest.get("created", time.time()), 1),
            "last_event": events[-1]["event"] if events else None,
            **history(events, acct.at(end or time.time())),
            **({"sweep": manifest["sweep"]} if "sweep" in manifest else {}),  # runner sweep: grouped by sweep.table
            # a recipe's stage (ESPnet3's run.py --stages ...): grouped with its recipe's other runs (``stages``)
            **({"stage": manifest["stage"], "recipe": manifest.get("cwd", "")} if "stage" in manifest else {}),
            **({"slurm_state": info.state, "slurm_source": info.source, "slurm_exit_code": info.exit_code,
                "reason": info.reason, "nodes": info.nodes} if info else {}),
            **(_parallel_store(run).status(state, manifest.get("items", 0)) if _is_parallel(manifest) else {})}, \
        acct, end


def _is_parallel(manifest: RunManifest) -> bool:
    return manifest.get("kind") == "parallel"


def is_parallel(run: RunDir) -> bool:
    """A `runner parallel` run (its manifest says so) rather than a training run."""
    return _is_parallel(run.manifest_record() or {})


def _parallel_store(run: RunDir) -> Any:
    from runner.parallel.store import Store

    return Store(run)


def broken_row(run: RunDir, problem: str) -> dict[str, Any]:
    """The row of a run whose files cannot be read: what is wrong, in place of its state."""
    return {"run": run.name, "path": str(run.root), "state": "unreadable", "job_id": None,
            "last_checkpoint_step": None, "restarts": None, "age_s": None, "last_event": None,
            "last_outcome": None, "last_cause": None, "lost_steps": [], "goodput": None, "wall_s": None,
            "productive_s": None, "losses_s": {}, "error": problem}


def history(events: Sequence[Mapping[str, Any]], acc: goodput.Goodput) -> dict[str, Any]:
    """What the failures cost: the last outcome and its cause, steps lost per restart, and goodput with its losses.

    Goodput is training time kept in checkpoints (or in the finished run) divided by wall time since submit
    (``runner.goodput``).
    """
    outcome, cause = last_outcome(events)
    return {"last_outcome": outcome, "last_cause": cause,
            "lost_steps": [e.get("lost_steps", 0) for e in events if e["event"] == "train_start"][1:],
            **acc.as_json()}


# What begins an attempt (its outcome is then not known yet) and what a person's cancel ends it with.
def last_outcome(events: Sequence[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """How the latest attempt that ended ended, and why: its ``exit``; ``cancelled`` when a person cancelled the
    run after it (the cancelled attempt's own end, whatever an older one said); (None, None) before any ended. A
    resubmitted run waiting for its next attempt shows what made it resubmit (a hang, a node)."""
    for e in reversed(events):
        if e["event"] == "exit" and e.get("outcome"):
            return e["outcome"], e.get("cause")
        if e["event"] == "cancelled":
            return "cancelled", None
    return None, None


LAST_WIDTH = 70  # the LAST column's outcome and cause, cut between words


def last_cell(outcome: str | None, cause: str | None) -> str:
    """The LAST column: the outcome and its cause on one line (a cause's newlines and runs of spaces folded, the
    outcome said once when the cause begins with it), cut between words with "..." past ``LAST_WIDTH``."""
    if outcome is None:
        return "-"
    text = " ".join((cause or "").split())
    if text.startswith(f"{outcome}:"):
        text = text[len(outcome) + 1:].lstrip()
    line = f"{outcome}: {text}" if text else outcome
    if len(line) <= LAST_WIDTH:
        return line
    cut = line[:LAST_WIDTH - 3].rsplit(" ", 1)[0].rstrip(" ,;:(")
    return f"{cut}..."


def accounting(run: RunDir, runs: Sequence[goodput.Attempt], manifest: RunManifest,
               last: tuple[int, Path] | None) -> goodput.Goodput:
    """The run's wall time since submission (its attempts: ``goodput.attempts``), split into kept training time
    and its named losses."""
    acct, end = _accounting(run, runs, manifest, last)
    return acct.at(end or time.time())


def _accounting(run: RunDir, runs: Sequence[goodput.Attempt], manifest: RunManifest,
                last: tuple[int, Path] | None) -> tuple[goodput.Accounting, float | None]:
    """What the run's goodput is worked out from, and the end of its wall time (None: it has not finished, now)."""
    done = read_json(run.finished, None)
    done = done if isinstance(done, dict) else {}
    kept, kept_step = done.get("productive_s"), done.get("step")
    if kept is None and last is not None:
        kept, kept_step = checkpoint.manifest_of(last[1]).get("productive_s"), last[0]
    stalls = {a.log_attempt: _hang_stall(run, a.log_attempt) for a in runs if a.hang and a.log_attempt}
    program = any(a.train_start is None for a in runs) and program_mode(run)  # the config only where it matters
    return goodput.Accounting(list(runs), manifest.get("created"), kept, kept_step, stalls, program), \
        done.get("time") or None


def program_mode(run: RunDir) -> bool:
    """Whether the run runs a program (``command:``): runner sees its steps only through ``runner.progress`` or a
    Lightning Trainer (then its ledger has ``train_start``)."""
    from runner.spec.typed import read_resolved

    try:
        return bool(read_resolved(run.config).get("command"))
    except Exception:  # an unreadable config: its row says so elsewhere
        return False


def _hang_stall(run: RunDir, attempt: int) -> float:
    """How long the steps of a hung attempt had stopped when its watchdog fired (the ranks' hang reports)."""
    reports = [read_json(p) for p in run.hang_reports(attempt).glob("rank-*.json")]
    return max((float(r["stalled_s"]) for r in reports if isinstance(r, dict)
                and isinstance(r.get("stalled_s"), (int, float))), default=0.0)


def _looks_like_run(path: Path) -> bool:
    try:
        return stat.S_ISREG(RunDir(path).config.stat().st_mode)
    except FileNotFoundError:
        return False
    except (OSError, ValueError):  # cannot look inside: show it, with what is wrong
        try:
            return stat.S_ISDIR(path.lstat().st_mode)
        except (OSError, ValueError):  # cannot even stat it: not a run of ours
            return False


def _entries(root: Path) -> list[Path]:
    """The entries of a run root, sorted; none when it cannot be listed."""
    try:
        base = Path(os.path.abspath(root))
        return [base / n for n in sorted(e.name for e in os.scandir(root))]
    except OSError:
        return []


def collect(name: str | None, root: Path) -> list[dict[str, Any]]:
    """Status rows of one run (by name) or of every run under root, Slurm asked once for all of them. Listing a root
    reads again only the runs whose files changed since the last look (``runner.host.statuscache``)."""
    if name:
        runs = [find_run(name, root)]
    else:
        runs = [RunDir(p) for p in _entries(root) if _looks_like_run(p)]
    memory = None if name else statuscache.load(root)
    now = time.time()
    rows: list[dict[str, Any] | None] = [memory.row(run, functools.partial(local.held, run), now) if memory else None
                                         for run in runs]
    read = [i for i, r in enumerate(rows) if r is None]
    sigs = {i: statuscache.signature(runs[i]) for i in read} if memory else {}  # before the files are read
    looks: dict[int, observe.Observation | Exception] = {}
    for i in read:
        try:
            looks[i] = observe.look(runs[i], observe.shown, strict=True)
        except Exception as e:  # its row says what is wrong below
            looks[i] = e
    jobs = observe.ask(o for o in looks.values() if isinstance(o, observe.Observation)) or {}  # one Slurm question
    kept: dict[int, tuple[observe.Observation, goodput.Accounting, float | None]] = {}
    for i in read:
        run, seen = runs[i], looks[i]
        try:
            if isinstance(seen, Exception):
                raise seen
            seen = seen.answered(jobs)
            r, acct, end = _row(seen)
            if not seen.needed and not _is_parallel(seen.manifest):  # Slurm's word and items change by themselves
                kept[i] = seen, acct, end
        except Exception as e:  # one unreadable run must not hide the others
            log.debug("%s: cannot read", run.root, exc_info=True)
            r = broken_row(run, runner_log.one_line(e))
        # A cause read from a log line may quote the webhook URL (ledgers written before redaction did): never show
        # it, whatever its source (each run's url_env, url_file or env:, learnt from its config), nor a Slack URL.
        if r.get("last_cause") or r.get("error"):  # free text (a cause, an error) may quote it; the rest is runner's
            _learn_secrets(run)
        rows[i] = r
    # A remembered row was redacted when it was read: again only where this look may know a secret it did not (the
    # webhook URL of this environment, or one that the runs read now taught it).
    url = os.environ.get(DEFAULT_URL_ENV, "").strip()
    out = [_redacted(r, [url] if url else []) if read or url else r for r in rows if r is not None]  # every one
    if memory is not None:
        for i, (seen, acct, end) in kept.items():
            memory.keep(runs[i], sigs[i], out[i], seen.manifest.get("created"), acct if end is None else None,
                        scheduler.of_manifest(seen.manifest).name == "local", now)
        memory.save([run.name for run in runs])
    return out


def _redacted(row: Mapping[str, Any], secrets: Sequence[str]) -> dict[str, Any]:
    """A row with every text in it redacted (``alerts.redact_obj``); its numbers and its losses (runner's names) need
    none."""
    from runner import alerts

    return {k: v if k == "losses_s" or v is None or isinstance(v, (int, float)) else alerts.redact_obj(v, secrets)
            for k, v in row.items()}


def _learn_secrets(run: RunDir) -> None:
    from runner.spec.typed import read_resolved

    try:
        read_resolved(run.config)  # remembers the run's webhook URLs (runner.redaction)
    except Exception:  # noqa: S110 -- its row says what is wrong with it
        pass


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _cell(r: dict[str, Any], col: str) -> str:
    value = r.get("age_s" if col == "age" else col)
    if value is None:
        return "-"
    return _age(value) if col == "age" else str(value)


TELLING_WALL_S = 3600.0  # below an hour without a restart, startup dominates goodput: it tells nothing


def telling(r: Mapping[str, Any]) -> bool:
    """Whether a run's goodput says something about it: after a restart (what the faults cost) or after an hour
    (a 6 s quickstart spends most of its life starting up). ``--json`` and ``runner report`` always show it."""
    return r.get("goodput") is not None and (bool(r.get("restarts")) or (r.get("wall_s") or 0) >= TELLING_WALL_S)


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs"
    cols = ("run", "state", "job_id", "last_checkpoint_step", "restarts", "lost_steps", "goodput", "last_outcome",
            "age")
    data = [[_cell(r, c) for c in cols] for r in rows]
    for r, d in zip(rows, data, strict=True):
        if r["state"] == "pending" and r.get("reason"):  # Slurm's reason: Resources, Priority, BeginTime, ...
            d[1] = f"pending ({r['reason']})"
        d[5] = ",".join(map(str, r["lost_steps"])) or "-"
        d[6] = f"{r['goodput']:.0%}" if telling(r) else "-"
        d[7] = last_cell(r.get("last_outcome"), r.get("last_cause"))
        if r.get("kind") == "parallel":  # a `runner parallel` run: items instead of checkpoints
            d[3] = f"{r['items_done']}/{r['items_total']} items" + (f", {r['items_failed']} failed"
                                                                    if r["items_failed"] else "")
        if r.get("error"):
            d[7] = f"error: {r['error'][:80]}"
    heads = ("RUN", "STATE", "JOB", "CKPT", "RESTARTS", "LOST", "GOODPUT", "LAST", "AGE")
    widths = [max(len(h), *(len(d[i]) for d in data)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*heads), *(fmt.format(*d) for d in data)])


def grouped_table(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], str | None],
                  head: Callable[[str, list[dict[str, Any]]], str], label: Callable[[dict[str, Any]], str],
                  order: Callable[[dict[str, Any]], Any] = lambda r: 0) -> str:
    """``table`` with the rows that share a ``key`` together (in ``order``) under one ``head`` line, at the place of
    the first of them, each run's cell followed by its ``label``; a row without a key keeps its place."""
    groups: dict[str, list[dict[str, Any]]] = {}
    places: list[str | dict[str, Any]] = []
    for r in rows:
        k = key(r)
        if k is None:
            places.append(r)
        elif k not in groups:
            groups[k] = [r]
            places.append(k)
        else:
            groups[k].append(r)
    if not groups:
        return table(rows)
    flat: list[dict[str, Any]] = []
    heads: dict[int, str] = {}
    for place in places:
        if isinstance(place, dict):
            flat.append(place)
            continue
        members = sorted(groups[place], key=order)
        heads[len(flat)] = head(place, members)
        width = max(len(r["run"]) for r in members)
        flat += [{**r, "run": f"  {r['run']:<{width}}  {label(r)}".rstrip()} for r in members]
    lines = table(flat).split("\n")
    return "\n".join([lines[0], *(x for i, line in enumerate(lines[1:]) for x in ([heads[i]] if i in heads else [])
                                   + [line])])


def stages_table(rows: list[dict[str, Any]]) -> str:
    """``table`` with a recipe's stage runs (ESPnet3's ``run.py --stages ...``, each a run) together under one line
    that names the recipe's directory and each stage's state, oldest first."""
    def head(recipe: str, members: list[dict[str, Any]]) -> str:
        return f"recipe {recipe}: " + ", ".join(f"{r['stage']} {r['state']}" for r in members)

    return grouped_table(rows, lambda r: r.get("recipe") if r.get("stage") else None, head,
                         lambda r: f"[{r['stage']}]", order=lambda r: -float(r.get("age_s") or 0))


def ranks(run: RunDir) -> str:
    """``runner status RUN --ranks``: the slowest ranks and their nodes against the median, and the last hang."""
    beats = [b for p in sorted(run.heartbeats.glob("rank-*.json")) if isinstance(b := read_json(p), dict)]
    newest = max((b.get("attempt", 0) for b in beats), default=0)
    out = [stragglers.table(stragglers.compare([b for b in beats if b.get("attempt", 0) == newest]))]
    hang = read_json(run.hang)
    if isinstance(hang, dict) and hang.get("summary"):
        out.append(f"last hang (attempt {hang.get('attempt')}, step {hang.get('step')}): {hang['summary']}")
    return "\n".join(out)


def ended(run: RunDir) -> bool | None:
    """Nothing more will be written to the logs (until a resubmission): the job's exit was recorded, or it gave up.

    A ``finished`` marker or a ``cancelled`` record is written while the ranks still run (rank 0 logs its last
    line after it): the run has ended once the scheduler says its processes have, or no longer knows them. None
    when Slurm does not know a job that wrote no end (any more, or its commands failed): the caller decides how
    long to believe that, since a controller restart or a network blip looks the same.
    """
    events = run.events()
    last = events[-1]["event"] if events else None
    if last in ("exit", "gave_up"):
        return True
    manifest = run.manifest_record() or {}
    ending = run.finished.exists() or last in ("cancelled", "finished")
    if _is_parallel(manifest):
        return ending
    sched = scheduler.of_manifest(manifest)
    if ending and sched is scheduler.RECORDS:  # no scheduler to ask: the run's own word
        return True
    live = sched.ended(run, run.job_id(), events)
    return live is not False if ending else live


@dataclass(frozen=True)
class BatchOutput:
    """The part of Slurm's batch output (``slurm-JOB.out``) one attempt wrote: a requeued job appends to its file,
    so an attempt's part runs from its ``start`` record's offset to the next attempt's in the same file."""

    path: Path
    begin: int = 0
    end: int | None = None  # None: to the file's end (the job's latest attempt)
    attempt: int | None = None


def batch_output(run: RunDir, attempt: int | None = None) -> BatchOutput:
    """The batch output of ``attempt`` (default: the latest attempt that started as a Slurm job), from the ledger's
    ``start`` records; without any (a run from before they named their attempt), the newest ``slurm-*.out``."""
    starts = [e for e in run.events() if e["event"] == "start" and e.get("job_id")]
    numbered = [e for e in starts if isinstance(e.get("attempt"), int)]
    if attempt is not None and not any(e["attempt"] == attempt for e in numbered):
        known = sorted({e["attempt"] for e in numbered})
        raise InputError(f"{run.name}: found no Slurm job that ran attempt {attempt}; expected one of "
                          f"{known or 'none recorded'}. hint: runner logs {run.name} --batch (the latest)")
    if not numbered:
        job = starts[-1]["job_id"] if starts else run.job_id()
        if job:
            return BatchOutput(run.batch_log(str(job)))
        outs = sorted(run.logs.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime)
        return BatchOutput(outs[-1] if outs else run.logs / "slurm-JOB.out")
    i = max(i for i, e in enumerate(numbered) if attempt is None or e["attempt"] == attempt)
    this = numbered[i]
    later = [e for e in numbered[i + 1:] if e["job_id"] == this["job_id"]]
    end = later[0].get("out_offset") if later else None
    return BatchOutput(run.batch_log(str(this["job_id"])), int(this.get("out_offset") or 0),
                       end if isinstance(end, int) else None, this["attempt"])


def log_path(run: RunDir, rank: int | None, attempt: int | None = None) -> Path:
    """A rank's log, or with ``rank=None`` Slurm's batch output (``slurm-JOB.out``: the batch shell, hooks)."""
    if rank is not None and is_parallel(run):  # `runner parallel`: the driver's
        return run.attempt_logs(attempt or (run.attempts() or [1])[-1]) / "driver.log"
    if rank is not None:
        return run.rank_log(rank, attempt)
    return batch_output(run, attempt).path


def logs(run: RunDir, rank: int | None, follow: bool, poll_s: float = 0.2, attempt: int | None = None) -> int:
    """Print a log; with ``follow``, keep printing until the run ends (waiting for the log to appear). The batch
    output (``rank=None``) is the part the attempt wrote; an earlier attempt's part has ended (no following)."""
    batch = rank is None and not is_parallel(run)
    part = batch_output(run, attempt) if batch else BatchOutput(log_path(run, rank, attempt))
    path = part.path
    follow = follow and part.end is None
    what = f"rank {rank}" if rank is not None else "the batch script"
    if not path.exists():
        if not follow:
            have = sorted(p.name for p in run.logs.glob("*")) if run.logs.is_dir() else []
            raise RunnerError(f"{path}: found no log for {what}; expected one of {have or 'none yet'}. "
                              "hint: --follow waits for it; --batch shows Slurm's output of the batch script")
        print(f"runner: waiting for {path} ...", file=sys.stderr, flush=True)
    check_every = max(1, int(2.0 / poll_s))
    polls = unknown = 0
    f = None
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    left = None if part.end is None else max(part.end - part.begin, 0)
    shown = 0

    def read() -> str:  # a huge log is streamed, never read whole; an attempt's part ends where the next begins
        nonlocal left, shown
        n = 1 << 20 if left is None else min(1 << 20, left)
        data = f.read(n) if f is not None and n else b""
        left = None if left is None else left - len(data)
        shown += len(data)
        text = decode(data)
        if text:
            sys.stdout.write(text)
        return text

    try:
        while True:
            if f is None and path.exists():
                if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open, a device never end
                    raise RunnerError(f"{path}: found no regular file; expected a log. hint: remove it")
                f = open(path, "rb")  # held open while following  # noqa: SIM115
                f.seek(part.begin)
            chunk = read()
            sys.stdout.flush()
            if not follow:
                while read():
                    pass
                if batch and not shown:
                    which = f"attempt {part.attempt}'s part of " if part.attempt is not None else ""
                    print(f"runner: {which}{path} is empty", file=sys.stderr)
                return 0
            polls += 1
            done = ended(run) if not chunk and polls % check_every == 0 else False
            unknown = unknown + 1 if done is None else 0
            if done or unknown >= 5:  # Slurm has not known the job for ~10 s: it is gone
                while read():  # what was written since the last read
                    pass
                sys.stdout.flush()
                return 0
            if not chunk:
                time.sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def cancel(run: RunDir, wait_s: float = 30) -> int:
    """Cancel the run through its scheduler (every rank gets SIGTERM and checkpoints) and wait until it ended.

    The ``cancelled`` marker is written first: the batch script's exit hook and ``runner cron`` read it and
    must not requeue or resubmit a job the user cancelled, however its launcher exited. A successor queued behind
    the job (resume.successor) is cancelled before the job, so that it never starts.
    """
    from runner.rundir import atomic_write

    job = run.job_id()
    manifest = run.manifest_record() or {}
    if run.finished.exists():
        print(f"run {run.name} already finished; nothing to cancel")
        return 0
    atomic_write(run.cancelled, json.dumps({"job_id": job, "time": time.time()}) + "\n")
    run.record("cancelled", job_id=job)
    if _is_parallel(manifest):  # the driver stops its workers (and their Slurm jobs) and keeps what is done
        gone = _parallel_store(run).stop_driver(wait_s)
        print(f"cancelled {run.name}" + ("" if gone else "; its driver runs on another host: stop it there"))
        return 0
    scheduler.of_manifest(manifest).cancel(run, job, wait_s)
    return 0
