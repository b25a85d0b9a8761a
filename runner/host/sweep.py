"""Sweeps: one config, many points, each point an ordinary run that carries the sweep's id.

It runs on the login node. ``runner sweep CONF model.lr=0.01,0.1 model.hidden=32,64`` expands the grid (the product of
the value lists, the first key slowest) and the explicit points of ``--points FILE`` (each point of the file with each
of the grid's), then plans every point as ``runner submit`` plans a run (``submit.plan``: the same checks, the same
files; the manifest names the sweep, its index and its values). Nothing else about a point differs from a run of its
own: each has its own run directory, ledger, checkpoints, alerts, resume.

- ``plan`` touches nothing (``--dry-run`` prints it); ``write`` records the sweep (``RUN_ROOT/sweeps/ID/sweep.json``,
  the points) and writes every point's run directory (pending); ``drive`` runs them.
- Locally (``scheduler: local``) ``drive`` runs the points one after another or N at a time (``--parallel N``), each
  by its own local driver in a process of its own (``runner.host.background``), and holds the sweep's lock while it
  does. A second ``drive`` of the sweep (``runner sweep --resume ID``) continues it: a completed point is left alone,
  one never started is started, a stopped one is resumed from its newest checkpoint (``action``, a table).
- On Slurm the sweep is one job array (``render.array``: ``--array=0-N%limit``, task i runs point i's own batch
  script in point i's run directory), submitted by ``submit_array``: each point's run records its task,
  ``ARRAYJOB_i`` (``slurmstates.job_id``: what the task records itself, and what squeue, sacct, scancel and
  ``scontrol requeue`` take), as its job, so the batch script's hooks, requeue, ``runner cron``, status, cancel and
  resume treat each task as the single job of one run. A task that fails is resubmitted by ``runner cron`` as that
  run's own plain job; the array is never submitted again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from runner import __version__, slurmstates, spec
from runner.errors import ConfigError, InputError, RunnerError, SubmitError
from runner.host import background, local, nodes, render, scheduler, slurm, submit
from runner.records import SweepMark
from runner.rundir import REPORT_PAGE, RunDir, Unreadable, atomic_write, lock_held, locked, read_json, read_regular
from runner.spec.load import parse_yaml, read_text
from runner.spec.typed import read_resolved

log = logging.getLogger(__name__)
Point = tuple[tuple[str, str], ...]  # (key.path, value as written) pairs, in the order they were given
MAX_POINTS = 10_000
HINT = "hint: model.lr=0.01,0.1"
CLAIM_TRIES = 20
LOCK_WAIT_S = 2.0  # a reader's look at the lock (``held``) is waited out


# ---------------------------------------------------------------------------------------------------------------
# The points


def split_values(text: str) -> list[str]:
    """``key=v1,v2``'s values: split at the commas outside brackets and quotes (``[1,2],[3,4]`` is two values,
    ``"a,b"`` one), each stripped."""
    values: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    values.append("".join(current).strip())
    return values


def axis(arg: str) -> tuple[str, list[str]]:
    """One ``key.path=v1,v2,...`` argument as its key and values.

    Raises:
        ConfigError: no ``=``, no key, an empty value, or one value twice (two equal points would be two equal runs).
    """
    key, sep, raw = arg.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError([f"sweep {arg!r}: found no '='; expected key.path=v1,v2,... {HINT}"])
    if not key:
        raise ConfigError([f"sweep {arg!r}: found no key before '='; expected key.path=v1,v2,... {HINT}"])
    values = split_values(raw)
    if "" in values:
        given = [v for v in values if v]
        raise ConfigError([f"sweep {key}: found an empty value (value {values.index('') + 1} of {len(values)} in "
                           f"{arg!r}); expected a value between every two commas. hint: "
                           f"{key}={','.join(given) if given else '1,2'}"])
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise ConfigError([f"sweep {key}: found the value {twice!r} twice; expected each value once (two equal "
                           "points are two equal runs). hint: sweep seed= for repeats"])
    return key, values


def _text(value: Any) -> str:
    """A value of a points file as an override's text (YAML flow style: a string that YAML reads as a number keeps
    its quotes)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _flat(entry: dict[Any, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A point's mapping as dotted keys: ``{model: {lr: 0.1}}`` is ``model.lr``."""
    for k, v in entry.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{key}.")
        else:
            yield key, v


def read_points(path: Path) -> list[Point]:
    """``--points FILE``: a YAML list of points, each a mapping of key paths to values (nested mappings are key
    paths too: ``{model: {lr: 0.1}}`` is ``model.lr: 0.1``).

    Raises:
        ConfigError: not a list of non-empty mappings, a key given twice in one point.
    """
    shape = ("a YAML list of points, each a mapping of key.path: value. hint: - {model.lr: 0.01, "
             "trainer.max_steps: 100}")
    data, _ = parse_yaml(read_text(path, "points"), str(path))
    if not isinstance(data, list) or not data:
        raise ConfigError([f"{path}: found {type(data).__name__ if data else 'no points'}; expected {shape}"])
    points = []
    for n, entry in enumerate(data, start=1):
        if not isinstance(entry, dict) or not entry:
            raise ConfigError([f"{path}: point {n}: found {type(entry).__name__ if entry else 'nothing'}; "
                               f"expected {shape}"])
        pairs = [(str(k), _text(v)) for k, v in _flat(entry)]
        keys = [k for k, _ in pairs]
        if twice := next((k for i, k in enumerate(keys) if k in keys[:i]), None):
            raise ConfigError([f"{path}: point {n}: found {twice} twice; expected each key once in a point"])
        points.append(tuple(pairs))
    return points


def expand(axes: Sequence[str], explicit: Sequence[Point] = ()) -> list[Point]:
    """Every point of the sweep: each explicit point with each combination of the axes' values (the first axis
    slowest), in that order.

    Raises:
        ConfigError: a bad axis (``axis``), a key given twice (two axes, or an axis and a point), no values at all,
            two equal points, or more than ``MAX_POINTS``.
    """
    parsed = [axis(a) for a in axes]
    seen: dict[str, str] = {}
    for arg, (key, _) in zip(axes, parsed, strict=True):
        if key in seen:
            raise ConfigError([f"sweep {key}: found it twice ({seen[key]!r} and {arg!r}); expected each key once. "
                               f"hint: one list, {key}=v1,v2,..."])
        seen[key] = arg
    for n, point in enumerate(explicit, start=1):
        if both := sorted({k for k, _ in point} & seen.keys()):
            raise ConfigError([f"sweep {both[0]}: found it in point {n} of the points file and in {seen[both[0]]!r}; "
                               "expected each key in one place. hint: drop it from one of them"])
    if not parsed and not explicit:
        raise ConfigError(["runner sweep: found no values to sweep; expected key.path=v1,v2,... or --points FILE. "
                           f"{HINT}"])
    size = max(len(explicit), 1)
    for _, values in parsed:
        size *= len(values)
    if size > MAX_POINTS:
        raise ConfigError([f"runner sweep: found {size} points; expected at most {MAX_POINTS}. hint: fewer values, "
                           "or several sweeps"])
    grid = list(itertools.product(*[[(k, v) for v in values] for k, values in parsed]))
    points = [tuple(p) + tuple(g) for p in (explicit or [()]) for g in grid]
    seen_points: set[frozenset[tuple[str, str]]] = set()
    for i, point in enumerate(points):
        if frozenset(point) in seen_points:
            raise ConfigError([f"runner sweep: found point {i} ({show(point)}) twice; expected distinct points. "
                               "hint: check the points file"])
        seen_points.add(frozenset(point))
    return points


def varied(points: Sequence[Point]) -> list[str]:
    """The keys whose values differ between the points (a key with one value everywhere is a plain override)."""
    values: dict[str, set[str]] = {}
    order: list[str] = []
    for point in points:
        for k, v in point:
            if k not in values:
                values[k] = set()
                order.append(k)
            values[k].add(v)
    return [k for k in order if len(values[k]) > 1 or any(k not in dict(p) for p in points)]


def overrides(point: Point) -> list[str]:
    return [f"{k}={v}" for k, v in point]


def show(point: Point | dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in (point.items() if isinstance(point, dict) else point))


def check(config: Path, points: Sequence[Point], base: Sequence[str] = ()) -> list[spec.Config]:
    """Load every point's config as ``runner validate`` would (nothing is asked of the system). A problem every point
    has is said as ``runner submit`` says it; one some points have is said with the first such point.

    Raises:
        ConfigError: a point's config is refused; a point that changes ``scheduler`` or ``run_root``.
    """
    cfgs: list[spec.Config] = []
    failed: list[tuple[int, ConfigError]] = []
    for i, point in enumerate(points):
        try:
            cfgs.append(spec.load(config, [*base, *overrides(point)]))
        except ConfigError as e:
            failed.append((i, e))
    if failed:
        i, first = failed[0]
        if len(failed) == len(points) and all(e.problems == first.problems for _, e in failed):
            raise first
        raise ConfigError([f"sweep point {i} ({show(points[i])}): {p}" for p in first.problems])
    for key in ("scheduler", "run_root"):
        values = [c.data[key] for c in cfgs]
        if len(set(values)) > 1:
            i = next(n for n, v in enumerate(values) if v != values[0])
            raise ConfigError([f"sweep point {i} ({show(points[i])}): found {key} {values[i]}, point 0 {values[0]}; "
                               f"expected one {key} for the whole sweep. hint: sweep each {key} on its own"])
    return cfgs


# ---------------------------------------------------------------------------------------------------------------
# The sweep's own folder


@dataclass(frozen=True)
class SweepDir:
    """``RUN_ROOT/sweeps/ID/``: what the sweep is (``sweep.json``), its driver's lock and output, its job array."""

    root: Path

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def run_root(self) -> Path:
        return self.root.parent.parent

    @property
    def record(self) -> Path:  # the sweep: its config, its points, its scheduler (``write``)
        return self.root / "sweep.json"

    @property
    def lock(self) -> Path:  # held (flock) by the sweep's driver while it runs points
        return self.root / "sweep.lock"

    @property
    def driver(self) -> Path:  # who drives it: {"pid", "host", "started"}, written once the lock is held
        return self.root / "driver.json"

    @property
    def console_log(self) -> Path:  # the driver's output when it runs in the background (the Python API)
        return self.root / "console.log"

    @property
    def array(self) -> Path:  # Slurm: the job array's batch script
        return self.root / "array.sbatch"

    @property
    def report_page(self) -> Path:  # `runner report --sweep`'s page comparing the sweep's runs
        return self.root / REPORT_PAGE

    def queued(self) -> bool:
        """Whether the sweep's runs are jobs of a queue (Slurm: its job array), not runs of a driver here."""
        rec = read_json(self.record)
        return scheduler.of(rec.get("scheduler") if isinstance(rec, dict) else None).queue

    def points(self) -> list[dict[str, str]]:
        """The sweep's points as ``write`` recorded them.

        Raises:
            InputError: no sweep record, or a damaged one."""
        try:  # read here, not by read_json: a damaged record is this one error line, not a warning besides
            rec = json.loads(read_regular(self.record).decode("utf-8"))
            found = "no list of points"
        except FileNotFoundError:
            rec, found = None, "no file"
        except Unreadable as e:
            rec, found = None, e.found
        except (OSError, ValueError) as e:
            rec, found = None, f"no readable JSON ({type(e).__name__})"
        pts = rec.get("points") if isinstance(rec, dict) else None
        if not isinstance(pts, list) or not all(isinstance(p, dict) for p in pts):
            raise InputError(f"sweep {self.id}: {self.record}: found {found}; expected the sweep's record, its points. "
                             "hint: `runner status` lists runs with their sweep")
        return [{str(k): str(v) for k, v in p.items()} for p in pts]

    def runs(self) -> dict[int, RunDir]:
        """The sweep's run directories by point index (by their manifests); where a point has two (planned again
        after a crash), the newest."""
        found: dict[int, tuple[float, RunDir]] = {}
        try:
            entries = sorted(e.path for e in os.scandir(self.run_root) if e.is_dir(follow_symlinks=False))
        except OSError:
            return {}
        for path in entries:
            run = RunDir(Path(path))
            if not run.manifest.is_file():
                continue
            m = run.manifest_record() or {}
            mark = m.get("sweep")
            if mark is None or mark["id"] != self.id:
                continue
            created = m.get("created", 0.0)
            if mark["index"] not in found or found[mark["index"]][0] <= created:
                found[mark["index"]] = (created, run)
        return {i: run for i, (_, run) in sorted(found.items())}


def new_sweep_dir(cfg: spec.Config, taken: Sequence[Path] = ()) -> SweepDir:
    """The next free sweep folder, ``sweep-NAME-YYYYmmdd-HHMMSS`` then ``-2``, ... (claimed by ``write``)."""
    return SweepDir(submit.free_dir(Path(cfg.data["run_root"]).resolve() / "sweeps", f"sweep-{cfg.name}", taken,
                                    "sweep folder"))


def find(name: str, root: Path) -> SweepDir:
    """A sweep by its folder's path or its id under ``root``.

    Raises:
        InputError: no such sweep."""
    for cand in (Path(name), root / "sweeps" / name):
        if (cand / "sweep.json").is_file():
            return SweepDir(cand.resolve())
    raise InputError(f"sweep {name!r}: found no sweep under {root}/sweeps/; expected a sweep's id or folder. hint: "
                     "`runner status` shows each run's sweep")


# ---------------------------------------------------------------------------------------------------------------
# Plan, write


@dataclass
class SweepPlan:
    """Everything a sweep writes and runs: one ``submit.Plan`` per point, and on Slurm the job array's script."""

    sweep: SweepDir
    config: Path
    points: list[Point]
    plans: list[submit.Plan]
    scheduler: str
    parallel: int
    array: str | None  # Slurm: the job array's batch script
    source: tuple[Path, list[str], Path | None, int | None, bool]  # plan()'s arguments: to plan again under a free id

    @property
    def id(self) -> str:
        return self.sweep.id

    @property
    def argv(self) -> list[str] | None:
        """Slurm: the sbatch command line of the job array."""
        return slurm.sbatch_argv(str(self.sweep.array)) if self.array is not None else None

    def __str__(self) -> str:
        how = f"one job array, at most {self.parallel} tasks at a time" if self.array is not None else \
            f"{self.parallel} at a time on this machine, each by its own driver"
        lines = [f"sweep:         {self.id} ({len(self.points)} runs; {how})", f"sweep record:  {self.sweep.record}",
                 f"scheduler:     {self.scheduler}"]
        if self.argv:
            lines.append(f"command:       {' '.join(self.argv)}")
        keys = varied(self.points)
        fixed = [(k, v) for k, v in self.points[0] if k not in keys]
        if fixed:
            lines.append(f"every run:     {show(tuple(fixed))}")
        width = max(len(str(p.run.root.name)) for p in self.plans)
        lines += ["", f"POINT  {'RUN DIRECTORY':<{width}}  VALUES"]
        lines += [f"{i:<5}  {p.run.root.name:<{width}}  {show(tuple((k, v) for k, v in pt if k in keys))}"
                  for i, (p, pt) in enumerate(zip(self.plans, self.points, strict=True))]
        notes = dict.fromkeys(n for p in self.plans for n in p.notes if n.startswith(("note:", "image check:")))
        lines += ["", *notes] if notes else []
        lines += ["", f"each run's files: runner submit --dry-run {self.config} {' '.join(overrides(self.points[0]))} "
                      "(point 0)"]
        if self.array is not None:
            lines += ["", f"--- {self.sweep.array} ---", self.array.rstrip("\n")]
        return "\n".join(lines)


def plan(config: Path, axes: Sequence[str], points_file: Path | None = None, parallel: int | None = None,
         allow_missing_image: bool = False) -> SweepPlan:
    """Validate and render every point of a sweep, without changing anything (``runner sweep --dry-run`` prints it).

    Raises:
        ConfigError: bad axes or points (``expand``), a point's config refused (``check``), a bad ``parallel``, points
            that one job array cannot hold (``render.array``).
    """
    _check_parallel(parallel)
    points = expand(axes, read_points(points_file) if points_file is not None else ())
    cfgs = check(config, points)
    sched = cfgs[0].data["scheduler"]
    sweep = new_sweep_dir(cfgs[0])
    shared = submit.context(config)  # git once for every point
    plans: list[submit.Plan] = []
    keys = varied(points)
    for i, (point, cfg) in enumerate(zip(points, cfgs, strict=True)):
        plans.append(submit.plan(config, overrides(point), allow_missing_image, _mark(sweep, i, points, keys), shared,
                                 [p.run.root for p in plans], cfg))
    queued = scheduler.of(sched).queue  # a queue takes the sweep as one job array
    limit = parallel or (len(points) if queued else 1)
    array = render.array(cfgs, sweep.id, sweep.root, [p.run.root for p in plans], limit,
                         scheduler.of(sched).slurm_version()) if queued else None
    return SweepPlan(sweep, config, points, plans, sched, limit, array,
                     (config, list(axes), points_file, parallel, allow_missing_image))


def _mark(sweep: SweepDir, index: int, points: Sequence[Point], keys: Sequence[str]) -> SweepMark:
    """A point's mark in its run's manifest: its values of the keys the sweep varies."""
    mine = dict(points[index])
    return {"id": sweep.id, "index": index, "size": len(points), "point": {k: mine[k] for k in keys if k in mine}}


def _check_parallel(parallel: int | None) -> None:
    if parallel is not None and parallel < 1:
        raise ConfigError([f"--parallel {parallel}: found a number below 1; expected how many runs at a time. "
                           "hint: --parallel 2"])


def write(sp: SweepPlan) -> SweepPlan:
    """Claim the sweep's folder, record the sweep, and write every point's run directory (each pending); returns the
    plan written (planned again under the next free id where another sweep took this one meanwhile)."""
    for _ in range(CLAIM_TRIES):
        sp.sweep.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            sp.sweep.root.mkdir()
            break
        except FileExistsError:
            sp = plan(*sp.source)
    else:
        raise SubmitError(f"sweep folder {sp.sweep.root}: found it taken after {CLAIM_TRIES} tries; expected a free "
                          "name. hint: run the sweep again")
    atomic_write(sp.sweep.record, json.dumps({
        "id": sp.id, "config_file": str(sp.config.resolve()), "scheduler": sp.scheduler, "parallel": sp.parallel,
        "points": [dict(p) for p in sp.points], "created": time.time(), "runner_version": __version__,
        "cwd": os.getcwd()}, indent=2) + "\n")
    sp.plans = [submit.write(p) for p in sp.plans]
    if sp.array is not None:
        atomic_write(sp.sweep.array, sp.array)
    return sp


def prepare(sp: SweepPlan) -> SweepPlan:
    """Check what only running the sweep refuses, then ``write`` it; returns the plan written.

    Raises:
        SubmitError: an image problem of a point.
    """
    for p in sp.plans:
        if p.image_problem:
            raise SubmitError(p.image_problem)
    return write(sp)


def execute(sp: SweepPlan) -> int:
    """Write the sweep and run it: on Slurm submit its job array (``submit_array``), else run it here (``drive``);
    returns the CLI's exit code (locally 0 when every point completed)."""
    if sp.array is not None:
        return submit_array(prepare(sp))
    return drive(prepare(sp).sweep, sp.parallel)


def submit_array(sp: SweepPlan) -> int:
    """sbatch a written sweep's job array, without the nodes the run root remembers as bad, and make task i the job
    of point i's run (``Slurm.submitted``: its ``job_id``, its successor, its ``submitted`` record), as
    ``runner submit`` makes a job a run's. A refusal removes what was written for it: no run directory without a
    job ever looks submitted.

    Raises:
        SubmitError: sbatch refused the array (in one line, as ``runner submit`` says it).
    """
    first = read_resolved(sp.plans[0].run.config)
    try:
        array, let_in = nodes.submit(str(sp.sweep.array), sp.sweep.run_root, first["resume"]["exclude_nodes_s"],
                                     needed=first["num_nodes"], partition=first["slurm"]["partition"])
    except SubmitError as e:
        for p in sp.plans:
            shutil.rmtree(p.run.root, ignore_errors=True)
        shutil.rmtree(sp.sweep.root, ignore_errors=True)
        raise scheduler.refused(e, "compare the config's num_nodes, num_device and slurm: block with "
                                   "`sinfo -N -o '%N %c %G'`") from None
    rec = read_json(sp.sweep.record)
    atomic_write(sp.sweep.record, json.dumps({**(rec if isinstance(rec, dict) else {}), "job": array}, indent=2)
                 + "\n")
    keys = varied(sp.points)
    for i, (p, point) in enumerate(zip(sp.plans, sp.points, strict=True)):
        task = slurmstates.task_id(array, i)
        scheduler.SLURM.submitted(p.run, read_resolved(p.run.config), task, p.world_size, let_in)
        values = show(tuple(kv for kv in point if kv[0] in keys))
        print(f"[{i + 1}/{len(sp.plans)}] {p.run.name}: job {task} ({values})", flush=True)
    print(f"sweep {sp.id}: submitted job array {array} ({len(sp.plans)} tasks, at most {sp.parallel} at a time); "
          f"runner status --root {sp.sweep.run_root} shows it, runner cron resubmits a task that fails", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Drive

Action = Literal["plan", "start", "resume", "done", "busy"]


def action(written: bool, finished: bool, held: bool, cancelled: bool, started: bool) -> tuple[Action, str]:
    """What a sweep's driver does with one point, from its run directory's facts: ``plan`` and start one not written
    (a crash before its directory was), ``start`` one written and never started, ``resume`` one stopped before its
    end (failed, interrupted, killed with its driver), nothing for a completed one, one a person cancelled (their
    word holds: ``runner resume RUN`` lifts it), or one whose processes run now."""
    if not written:
        return "plan", "not written yet"
    if finished:
        return "done", "completed"
    if held:
        return "busy", "its processes run now, under another driver: left to them"
    if cancelled:
        return "done", "cancelled by a person: left as it is (runner resume RUN restarts it)"
    if not started:
        return "start", "pending"
    return "resume", "stopped before its end: resumed from its newest complete checkpoint"


@dataclass
class _Point:
    index: int
    run: RunDir | None
    driver: background.Driver | None = None


class _Driver:
    """One sweep's points, at most ``parallel`` of them running at a time, each by its own local driver."""

    def __init__(self, sweep: SweepDir, parallel: int) -> None:
        self.sweep, self.parallel = sweep, parallel
        rec = read_json(sweep.record)
        self.record: dict[str, Any] = rec if isinstance(rec, dict) else {}
        self.points = sweep.points()
        self.keys = varied([tuple(p.items()) for p in self.points])
        self.stop: int | None = None  # the signal that asked the sweep to stop
        self.done: queue.Queue[int] = queue.Queue()
        self.live: dict[int, _Point] = {}
        self.outcomes: dict[int, str] = {}

    def say(self, index: int, run: RunDir | None, what: str) -> None:
        name = run.name if run is not None else "-"
        print(f"[{index + 1}/{len(self.points)}] {name}: {what}", flush=True)

    def begin(self, index: int, run: RunDir | None) -> None:
        """Start one point in the background: plan and write it first where it was never written."""
        facts = (run is not None, run is not None and run.finished.exists(), run is not None and local.held(run),
                 run is not None and run.cancelled.exists(), run is not None and bool(run.events()))
        what, why = action(*facts)
        if what in ("done", "busy"):
            self.outcomes[index] = "completed" if why == "completed" else what
            self.say(index, run, why)
            return
        if what == "plan":
            run, what = self.write(index), "start"
        assert run is not None
        world = _world_size(run)
        driver = background.start(run, world) if what == "start" else background.resume(run, [])
        values = {k: v for k, v in self.points[index].items() if k in self.keys}
        self.say(index, run, f"started ({show(values)})" if what == "start" else f"resumed: {why}")
        self.live[index] = _Point(index, run, driver)
        if self.stop is not None:  # the signal came while this point was starting: it stops too
            with contextlib.suppress(OSError):
                os.kill(driver.process.pid, self.stop)
        threading.Thread(target=self._wait, args=(index, driver), daemon=True, name=f"point-{index}").start()

    def write(self, index: int) -> RunDir:
        """Plan and write a point that has no run directory (the sweep's first driver died before it wrote it), as
        the sweep planned its others: from the directory the sweep was planned in (``run_root`` is relative to it)."""
        points = [tuple(p.items()) for p in self.points]
        mark = _mark(self.sweep, index, points, varied(points))
        point = points[index]
        config = Path(str(self.record.get("config_file", "")))
        here = os.getcwd()
        there = str(self.record.get("cwd", here))
        os.chdir(there if os.path.isdir(there) else here)
        try:
            p = submit.plan(config, overrides(point), sweep=mark)
            if p.image_problem:
                raise SubmitError(p.image_problem)
            return submit.write(p).run
        finally:
            os.chdir(here)

    def _wait(self, index: int, driver: background.Driver) -> None:
        driver.wait()
        self.done.put(index)

    def on_signal(self, signum: int, frame: object) -> None:
        """A first Ctrl-C or SIGTERM: no point starts any more, and each running one is asked to stop as its own
        driver asks its ranks (they checkpoint); a second Ctrl-C is passed on too (its driver kills its ranks)."""
        if self.stop is None:
            print(f"\nstopping the sweep: {len(self.live)} running runs checkpoint and stop; "
                  f"runner sweep --resume {self.sweep.id} continues it", file=sys.stderr, flush=True)
        self.stop = signum
        for p in list(self.live.values()):
            if p.driver is not None:
                with contextlib.suppress(OSError):
                    os.kill(p.driver.process.pid, signum)

    def run(self) -> int:
        existing = self.sweep.runs()
        todo = list(range(len(self.points)))
        while todo or self.live:
            while todo and len(self.live) < self.parallel and self.stop is None:
                index = todo.pop(0)
                try:
                    self.begin(index, existing.get(index))
                except RunnerError as e:
                    self.outcomes[index] = "not started"
                    self.say(index, existing.get(index), f"not started: {' '.join(str(e).split())}")
            if not self.live:
                break
            try:
                index = self.done.get(timeout=1.0)
            except queue.Empty:
                continue
            point = self.live.pop(index)
            assert point.run is not None
            from runner.host import status

            state = status.row(point.run)["state"]
            self.outcomes[index] = state
            self.say(index, point.run, state)
        return self.summary(todo)

    def summary(self, left: list[int]) -> int:
        counts: dict[str, int] = {}
        for state in self.outcomes.values():
            counts[state] = counts.get(state, 0) + 1
        if left:
            counts["not started (stopped)"] = len(left)
        said = ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        print(f"sweep {self.sweep.id}: {said}", flush=True)
        if all(state == "completed" for state in self.outcomes.values()) and not left:
            return 0
        print(f"next: runner sweep --resume {self.sweep.id} --root {self.sweep.run_root} (runs the points not "
              "completed; a completed one is left as it is)", flush=True)
        return 130 if self.stop == signal.SIGINT else 1


def _world_size(run: RunDir) -> int:
    m = run.manifest_record() or {}
    return m.get("world_size", 1)


def submit_queued(driver: _Driver) -> int:
    """``runner sweep --resume`` of a Slurm sweep: a point whose run never got a job (its submitter died before sbatch,
    or before it wrote the run) is submitted now, as a job of its own; a point with a job is left to it (a task that
    fails is ``runner cron``'s to resubmit, ``runner resume RUN``'s by hand). Returns 0 when every point has a job."""
    existing = driver.sweep.runs()
    left = 0
    for index in range(len(driver.points)):
        run = existing.get(index)
        job = run.job_id() if run is not None else None
        if run is not None and job:
            driver.say(index, run, f"job {job}: left to it (runner cron resubmits a job that fails)")
            continue
        try:
            run = run or driver.write(index)
            scheduler.SLURM.start(run, _world_size(run))  # prints the job
        except RunnerError as e:
            left += 1
            driver.say(index, run, f"not submitted: {' '.join(str(e).split())}")
    return 1 if left else 0


def drive(sweep: SweepDir, parallel: int | None = None) -> int:
    """Run the sweep's points that are not completed, ``parallel`` at a time (default: as the sweep was planned),
    holding the sweep's lock (one driver per sweep); returns 0 when every point completed.

    A Slurm sweep's points are their jobs' (``submit_queued``).

    Raises:
        SubmitError: another driver holds the sweep.
        InputError: the sweep's record cannot be read.
    """
    _check_parallel(parallel)
    rec = read_json(sweep.record)
    rec = rec if isinstance(rec, dict) else {}
    queued = scheduler.of(str(rec.get("scheduler", "local"))).queue
    n = parallel or (rec["parallel"] if isinstance(rec.get("parallel"), int) and rec["parallel"] >= 1 else 1)
    driver = _Driver(sweep, n)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        with locked(sweep.lock, blocking=False) as mine:
            if mine:
                atomic_write(sweep.driver, json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                       "started": time.time()}) + "\n")
                if queued:
                    return submit_queued(driver)
                old = {s: signal.signal(s, driver.on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
                    if threading.current_thread() is threading.main_thread() else {}
                try:
                    return driver.run()
                finally:
                    for s, handler in old.items():
                        signal.signal(s, handler)
        if time.monotonic() > deadline:
            who = read_json(sweep.driver)
            pid = who.get("pid") if isinstance(who, dict) else None
            raise SubmitError(f"sweep {sweep.id}: its driver runs now (pid {pid}, holding {sweep.lock}); expected "
                              "one driver per sweep. hint: let it end, or stop it (Ctrl-C, or kill -INT PID) first")
        time.sleep(0.02)


def held(sweep: SweepDir) -> bool:
    """Whether a driver runs the sweep now (it holds the sweep's lock)."""
    return lock_held(sweep.lock)


# ---------------------------------------------------------------------------------------------------------------
# runner status


def table(rows: list[dict[str, Any]]) -> str:
    """``status.table`` with a sweep's runs together under one line that names the sweep and counts its states (at
    the place of its first run), each with its point's values; a run of its own keeps its place."""
    from runner.host import status

    def head(sid: str, members: list[dict[str, Any]]) -> str:
        counts: dict[str, int] = {}
        for r in members:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        size = members[0]["sweep"].get("size", len(members))
        return (f"sweep {sid}: {len(members)} of {size} runs, "
                + ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1])))

    return status.grouped_table(rows, lambda r: r["sweep"].get("id") if isinstance(r.get("sweep"), dict) else None,
                                head, lambda r: show(r["sweep"]["point"]), order=lambda r: r["sweep"]["index"])
