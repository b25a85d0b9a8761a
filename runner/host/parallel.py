"""``runner parallel CONF``: plan a workload's run as a value, then drive it on Dask from this machine.

The driver runs here (the login node, or a laptop: hence runner.host) and never imports the workload: the workers do
(``runner.parallel.worker``). ``env: local`` and ``local_gpu`` start worker processes on this machine;
``env: slurm`` starts them as Slurm jobs (dask-jobqueue) in the same image, runtime and binds as training.
The driver alone writes results (``runner.parallel.store``), so a lost worker costs a recomputed chunk, never
a duplicate; a rerun of the same workload continues the same run directory and skips what is done.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import yaml

from runner import __version__, ledger, proc, spec
from runner.alerts import nextstep
from runner.errors import RunnerError
from runner.log import one_line
from runner.parallel import plan as P
from runner.parallel.store import Store
from runner.records import RunManifest
from runner.rundir import RunDir, atomic_write, locked, read_json
from runner.spec.typed import Parallel

log = logging.getLogger(__name__)
LOG_EVERY_S = 10.0  # progress lines when stderr is not a terminal


@dataclass
class Plan:
    """Everything ``execute`` will do; ``str()`` is the dry run."""

    cfg: spec.Config
    run: RunDir
    left: list[tuple[P.Chunk, list[int]]]
    total: int
    done: int
    workers: str
    cluster_kwargs: dict[str, Any] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)

    @property
    def par(self) -> Parallel:
        return self.cfg.data["parallel"]

    @property
    def code_env(self) -> dict[str, str]:
        """The workers import the workload from the config's directory (validation only read the source there:
        nothing of the user's is imported on this host)."""
        return {P.CODE_PATH_ENV: str(self.cfg.path.resolve().parent)}

    @property
    def items_left(self) -> int:
        return sum(len(items) for _, items in self.left)

    def __str__(self) -> str:
        par = self.par
        lines = [f"run directory: {self.run.root}", f"env:           {par['env']} ({self.workers})",
                 f"workload:      {par['forward']} over {self.total} items, provider "
                 f"{par['provider'].get('_target_', '(none)')}",
                 f"chunks:        {len(self.left)} to run of {-(-self.total // par['chunk_size'])} "
                 f"({par['chunk_size']} items each); {self.done} items done, {self.items_left} left",
                 f"retries:       {par['retries']} per item"]
        if self.cluster_kwargs:
            lines += ["", "--- dask-jobqueue SLURMCluster arguments ---",
                      yaml.safe_dump(self.cluster_kwargs, sort_keys=True).rstrip()]
        return "\n".join(lines)


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES when set, else the GPUs nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    out = proc.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], timeout=20, check=False)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _worker_python(cfg: spec.Config, run: RunDir) -> str:
    """How a Slurm worker job starts Python: the training job's exec prefix (same runtime, image and binds)."""
    from runner.host import build, render

    c = cfg.data["container"]
    image = build.image_path(cfg) if c["runtime"] != "none" else "none"
    if c["runtime"] != "none" and not c["allow_missing_image"]:
        problem = build.image_problem(cfg, Path(image))
        if problem:
            raise RunnerError(f"{problem}. hint: run `runner build {cfg.path}` first, or set "
                              "container.allow_missing_image: true if the image exists where the jobs run")
    binds = sorted({str(run.root.parent), *c["binds"]})
    return render.job_python(cfg, image, binds, [P.CODE_PATH_ENV, *cfg.data["env"]], str(run.root))


def plan(path: Path, overrides: list[str]) -> Plan:
    """Validate the config and find what is left to do; nothing is written."""
    cfg = spec.load(path, overrides, kind="parallel")
    name = f"{cfg.name}-{P.workload_hash(cfg.data['parallel'])}"
    root = Path(cfg.data["run_root"]).resolve() / name
    cfg = spec.load(path, overrides, run_dir=str(root), kind="parallel")
    par, run = cfg.data["parallel"], RunDir(root)
    total, store = int(par["items"] or 0), Store(run)
    left = []
    for chunk in P.chunks(total, par["chunk_size"]):
        items = P.todo(chunk, store.read(chunk.index)[0])
        if items:
            left.append((chunk, items))
    p = Plan(cfg, run, left, total, total - sum(len(i) for _, i in left), "")
    threads = int(par["options"].get("threads_per_worker", 1))
    if par["env"] == "slurm":
        from runner.host.render import q

        if not spec.SBATCH_SAFE.match(str(run.root)):  # dask-jobqueue writes it into #SBATCH -o/-e lines
            raise RunnerError(f"run directory {run.root}: found characters sbatch cannot read in #SBATCH lines; "
                              "expected letters, digits and _.-/ hint: set run_root to such a path")

        env = {"RUNNER_RUN_DIR": run.root, "OMP_NUM_THREADS": par["options"].get("cores", 1),
               **p.code_env, **cfg.data["env"]}
        prologue = [f"export {k}={q(v)}" for k, v in env.items()]
        p.cluster_kwargs = P.slurm_kwargs(par, cfg.data["slurm"], job_name=f"par-{name}"[:64],
                                          log_dir=str(run.logs / "workers"), python=_worker_python(cfg, run),
                                          prologue=prologue)
        p.workers = f"{par['n_workers']} Slurm worker jobs"
    elif par["env"] == "local_gpu":
        p.gpus = visible_gpus()
        if not p.gpus:
            raise RunnerError("parallel.env: found local_gpu but no visible GPU (CUDA_VISIBLE_DEVICES, nvidia-smi); "
                              "expected at least one. hint: use env: local on a machine without GPUs")
        if par["n_workers"] > len(p.gpus):
            log.warning("parallel.n_workers is %d but %d GPUs are visible: one worker per GPU",
                        par["n_workers"], len(p.gpus))
        p.workers = f"{min(par['n_workers'], len(p.gpus))} worker processes, GPUs {','.join(p.gpus[:par['n_workers']])}"
    else:
        p.workers = f"{par['n_workers']} worker processes x {threads} threads"
    return p


class Stopped(Exception):
    """SIGTERM (``runner cancel``) reached the driver."""


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise Stopped()


@contextmanager
def _one_driver(store: Store) -> Iterator[None]:
    """One driver per run directory: a second one is refused at once (flock, released when the driver dies)."""
    with locked(store.lock, blocking=False) as held:
        if not held:
            who = read_json(store.driver, {}) or {}
            raise RunnerError(f"run {store.run.name}: found another `runner parallel` working on it (pid "
                              f"{who.get('pid', '?')} on {who.get('host', '?')}); expected one at a time. "
                              "hint: wait for it, or `runner cancel` it")
        yield


def _cluster(p: Plan) -> Any:
    par = p.par
    if par["env"] == "slurm":
        from dask_jobqueue.slurm import SLURMCluster

        try:
            cluster = SLURMCluster(**p.cluster_kwargs)
        except (TypeError, ValueError) as e:
            raise RunnerError(f"parallel.options: dask-jobqueue refused them: {one_line(e)}. "
                              "hint: see dask-jobqueue's SLURMCluster arguments") from None
        cluster.scale(jobs=par["n_workers"])  # type: ignore[no-untyped-call]
        return cluster
    from distributed import Nanny, Scheduler, SpecCluster

    threads = int(par["options"].get("threads_per_worker", 1))
    extra = {"memory_limit": par["options"]["memory_limit"]} if "memory_limit" in par["options"] else {}
    envs = P.worker_envs(par["env"], par["n_workers"], threads, p.gpus)
    common = {"host": "127.0.0.1", "dashboard": False, "silence_logs": logging.ERROR, "nthreads": threads, **extra}
    workers = {f"worker-{i}": {"cls": Nanny, "options": {**common, "env": {**env, **p.code_env}}}
               for i, env in enumerate(envs)}
    # No dashboard; its HTTP server (health, metrics) on a free port rather than a warning about a taken 8787.
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)  # type: ignore[no-untyped-call]


class _Progress:
    """A bar on a terminal, a log line every LOG_EVERY_S otherwise (and in the driver's log)."""

    def __init__(self, done: int, total: int) -> None:
        self.start_done, self.done, self.total, self.failed = done, done, total, 0
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, done: int, failed: int) -> None:
        self.done += done
        self.failed += failed
        now = time.monotonic()
        rate = (self.done - self.start_done) / max(now - self.t0, 1e-9)
        line = P.progress(self.done, self.total, self.failed, rate)
        if self.tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        if now - self.last >= LOG_EVERY_S or self.done + self.failed >= self.total:
            self.last = now
            log.log(logging.DEBUG if self.tty else logging.INFO, "progress: %s", line)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _drive(p: Plan, attempt: int) -> None:
    """Start the cluster, run every chunk left, write each as it arrives, reduce at the end."""
    from distributed import Client, as_completed

    from runner.parallel import worker

    par, store = p.par, Store(p.run)
    progress = _Progress(p.done, p.total)
    dask_log = logging.getLogger("distributed")
    level = dask_log.level
    try:
        with _cluster(p) as cluster, Client(cluster) as client:  # type: ignore[no-untyped-call]
            log.info("cluster up (%s); %d items in %d chunks", p.workers, p.items_left, len(p.left))
            targets = [t for t in (par["provider"].get("_target_"), par["forward"], par["reduce"]) if t]
            client.register_plugin(worker.preload(targets))
            futures = {client.submit(worker.run_chunk, par["provider"], par["forward"], items, par["retries"],
                                     key=f"chunk-{chunk.index}-attempt-{attempt}", pure=False): (chunk, items)
                       for chunk, items in p.left}
            try:
                for fut in as_completed(futures):  # type: ignore[no-untyped-call]
                    chunk, items = futures[fut]
                    if fut.status == "error":  # the task itself was lost (e.g. its workers kept dying)
                        results, failed = {}, {i: one_line(cast(BaseException, fut.exception())) for i in items}
                    else:
                        results, failed, setup_error = fut.result()
                        if setup_error:
                            raise RunnerError(f"the workload could not start in a worker: {setup_error}. hint: "
                                              "check parallel.provider and parallel.forward")
                    store.merge(chunk.index, results, failed)
                    progress.add(len(results), len(failed))
            except BaseException:
                # The chunks still queued are dropped, and Dask's own teardown is not shown, here or in the workers:
                # its scheduler logs CRITICAL tracebacks about the client that left while workers held results for
                # it, a worker its heartbeat's to the scheduler that left. The one line that matters is runner's.
                client.cancel(list(futures))
                client.run(worker.quiet, on_error="ignore")
                worker.quiet()
                raise
            finally:
                progress.close()
            if par["reduce"] and not progress.failed and progress.done == p.total:
                value = client.submit(worker.run_reduce, par["reduce"], str(p.run.root), pure=False).result()
                atomic_write(store.result, json.dumps(value, indent=1) + "\n")
    finally:
        dask_log.setLevel(level)


@contextmanager
def _driver_log(run: RunDir, attempt: int) -> Iterator[Path]:
    """The driver's own log (``logs/attempt-N/driver.log``, what `runner logs` shows) next to stderr."""
    from runner.log import STAMPED

    path = run.attempt_logs(attempt) / "driver.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(STAMPED, datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger("runner")
    root.addHandler(handler)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()


def _write_run(p: Plan) -> bool:
    """The run directory's config and manifest (kind: parallel); True when this is the run's first start."""
    first = not p.run.manifest.exists()
    p.run.root.mkdir(parents=True, exist_ok=True)
    old = (p.run.manifest_record() or {}) if not first else {}
    manifest: RunManifest = {
        "runner_version": __version__, "kind": "parallel", "scheduler": "local", "env": p.par["env"],
        "config_file": str(p.cfg.path.resolve()), "items": p.total, "created": old.get("created", time.time()),
        "host": socket.gethostname()}
    atomic_write(p.run.config, yaml.safe_dump(dict(p.cfg.data), sort_keys=False))
    p.run.write_manifest(manifest)
    return first


def _alert(p: Plan, event: ledger.AlertEvent, log_path: Path, **fields: Any) -> None:
    from runner import alerts

    tail = log_path.read_text(errors="replace").splitlines()[-20:] if log_path.exists() else []

    alerts.notify(p.run.root, p.cfg.data["alerts"], event, log_tail=tail,
                  next_step=nextstep.next_step(event, by="parallel", run=p.run.name), **fields)


def _report(p: Plan, done: int, failures: dict[int, str],
            stopped: ledger.Outcome | None) -> tuple[int, ledger.Outcome, str | None]:
    """(exit code, outcome, cause) of an attempt, with the failed items listed in the log."""
    if stopped:
        return 130, stopped, None
    if not failures:
        log.info("done: %d items%s", done, f"; result in {Store(p.run).result}" if p.par["reduce"]
                 else "")
        return 0, "completed", None
    shown = list(failures.items())[:10]
    log.error("%d items failed after %d retries; a rerun tries them again:", len(failures), p.par["retries"])
    for idx, err in shown:
        log.error("  item %d: %s", idx, err)
    if len(failures) > len(shown):
        log.error("  ... and %d more (parallel/chunks/*.json, key \"failed\")", len(failures) - len(shown))
    return 1, "failed", f"{len(failures)} of {p.total} items failed; first: item {shown[0][0]}: {shown[0][1]}"


def need_dask(env: str) -> None:
    """The driver's Dask comes with runner's ``parallel`` extra: without it, one line instead of a traceback."""
    for module in ("distributed", *(("dask_jobqueue",) if env == "slurm" else ())):
        try:
            importlib.import_module(module)  # the driver imports it next anyway
        except ImportError:
            raise RunnerError(f"runner parallel: found no `{module}` in {sys.executable}; expected runner's "
                              "`parallel` extra (Dask) installed in the Python that runs runner. "
                              "hint: pip install 'runner[parallel]'") from None


def execute(p: Plan) -> int:
    """Run what is left; 0 when every item is done, 1 when some failed (listed), 130 when stopped."""
    if not p.left:
        print(f"nothing to do: all {p.total} items of {p.run.name} are done")
        return 0
    need_dask(p.par["env"])
    store = Store(p.run)
    with _one_driver(store):
        first = _write_run(p)
        attempt = p.run.new_attempt()
        p.run.cancelled.unlink(missing_ok=True)  # running it again lifts a cancel, as `runner resume` does
        p.run.record("submitted" if first else "resubmitted", kind="parallel", env=p.par["env"])
        atomic_write(store.driver, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                               "attempt": attempt}) + "\n")
        p.run.record("start", attempt=attempt, items_left=p.items_left)
        previous = signal.signal(signal.SIGTERM, _on_term)
        error: Exception | None = None
        with _driver_log(p.run, attempt) as log_path:
            log.info("run %s, attempt %d: %d of %d items left", p.run.name, attempt, p.items_left, p.total)
            stopped: ledger.Outcome | None = None
            try:
                _drive(p, attempt)
            except (Stopped, KeyboardInterrupt):
                stopped = "cancelled" if p.run.cancelled.exists() else "stopped"
                log.warning("%s: the items done are kept; run it again to continue", stopped)
            except Exception as e:  # recorded (status, alert), then raised: a RunnerError as one line
                error = e
            finally:
                signal.signal(signal.SIGTERM, previous)
            done, failures = store.summary()
            code, outcome, cause = (1, "failed", one_line(error)) if error else _report(p, done, failures, stopped)
        p.run.write_exit_status({"exit_code": code, "cancelled": outcome == "cancelled", "time": time.time()})
        fields: ledger.Exit = {"outcome": outcome, "exit_code": code, "attempt": attempt, "items_done": done,
                               "items_failed": len(failures)}
        if cause:
            fields["cause"] = cause
        p.run.record("exit", **fields)
        if code == 0:
            atomic_write(p.run.finished, json.dumps({"time": time.time(), "items": done}) + "\n")
            _alert(p, "completed", log_path)
        elif outcome == "failed":
            _alert(p, "failed", log_path, exit_code=1, cause=cause)
    if error:
        raise error
    return code


def resume(run: RunDir, overrides: list[str]) -> int:
    """`runner resume RUN` of a parallel run: run its resolved config again (the same workload, so the same
    directory), with overrides such as ``parallel.n_workers=8``."""
    p = plan(run.config, overrides)
    if p.run.root != run.root:
        raise RunnerError(f"{run.root}: found overrides that change the workload (its run directory would be "
                          f"{p.run.root}); expected env, n_workers or options only. hint: use `runner parallel CONF`")
    return execute(p)
