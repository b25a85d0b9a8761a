"""Program mode: the config's ``command:`` runs as this rank, unchanged, with runner's guarantees around it.

The launcher has done what needs no program (signal handlers, the rank log, the network environment, the preflight);
here the rank gets the variables every launcher gives (torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; under srun also Slurm's, which Lightning's
``SLURMEnvironment`` reads) and the command runs. ``python SCRIPT ...`` and ``python -m MODULE ...`` run in this
process, as the interpreter would run them (``runpy``): no second interpreter, no second import of torch, and the
signal handlers stay the launcher's. Any other command is a child process that gets every signal the launcher gets.

In the program, each Lightning ``Trainer`` gets runner's callback through Lightning's callback-factory entry point
(``runner.job.program_entry.factory``), which also resumes its ``fit`` from runner's newest checkpoint. What the fit did
comes back in a small per-rank file, from which this module makes the exit code the batch script understands.
"""

from __future__ import annotations

import logging
import os
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from runner import rundir
from runner.job import imports, jobenv, outcome, stephook
from runner.job.stopflag import StopFlag, stop_flag
from runner.records import ProgramOutcome, RunManifest
from runner.rundir import EXIT_PROGRAM, EXIT_REQUEUE, OWNER_FD_ENV, RunDir
from runner.spec.typed import RunConfig
from runner.world import FABRIC_ENV, fabric_run, rank_env

log = logging.getLogger(__name__)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")


def in_process(command: list[str]) -> bool:
    """``python SCRIPT ...`` or ``python -m MODULE ...`` with the rank's own Python (``python``, ``python3``,
    ``python3.12``, or this interpreter's own path): run here, like the interpreter. Another interpreter's path
    (another venv, the system's) is a child process: its packages are not this one's."""
    own = os.path.abspath(command[0]) == os.path.abspath(sys.executable) if command else False
    if len(command) < 2 or not (_PYTHON.fullmatch(command[0]) or own):
        return False
    return command[1] == "-m" and len(command) > 2 or not command[1].startswith("-")


def launched(command: list[str]) -> tuple[list[str], dict[str, str]]:
    """What the rank runs, and the variables it adds: ``fabric run [OPTIONS] SCRIPT ARGS`` is ``python SCRIPT ARGS``
    with what ``fabric run`` sets (``LT_CLI_USED`` and its options' ``LT_*``): runner is its launcher, as torchrun is
    under ``fabric run``, so no second launcher starts. Its ``--devices``/``--num-nodes`` are runner's world (``runner
    validate`` refuses others; ``rank_env`` sets them). Any other command is itself."""
    fabric = fabric_run(command)
    if fabric is None:
        return command, {}
    return [sys.executable, *fabric.script], {k: v for k, v in fabric.settings.items() if k not in FABRIC_ENV}


HINTS = {"not_found": "check command: in the config (it runs in the directory runner submit ran in)",
         "missing_package": "run the ranks with the Python that has the program's packages: submit with its venv's "
                            "`runner` (or `python -m runner`), or in an image that has them (container.runtime, "
                            "container.python)"}


def needs(command: list[str], cwd: Path) -> list[imports.Need]:
    """The third-party packages this rank's Python must have to start ``command`` in ``cwd``: the top
    package of ``python -m pkg.mod``, a script's top-level imports; none for a command that is not run by this
    Python (another interpreter's path, a binary: their packages are not this one's)."""
    command = launched(command)[0]
    if not in_process(command):
        return []
    if command[1] == "-m":
        return imports.module_needs(command[2], cwd)
    return imports.script_needs(cwd / command[1])


def refusal(lacking: list[imports.Need], python: str = sys.executable) -> str:
    """What was found, in one line: the Python (this one, and its container when the caller names it), the package
    it cannot find and the program's line that imports it."""
    first = lacking[0]
    more = f" (and {', '.join(n.package for n in lacking[1:])})" if lacking[1:] else ""
    return f"{python} cannot find {first.package}{more}, which {first.where} imports: `{first.text}`"


def problem(command: list[str], cwd: Path, packages: bool = True) -> tuple[Literal["not_found", "missing_package"],
                                                                            str] | None:
    """Why ``command`` cannot start here: its ledger reason and one line; None when it can. ``packages``: whether
    the packages it imports are looked up here too (else the preflight does, naming the Python in its report)."""
    if fabric_run(command) is not None and len(launched(command)[0]) < 2:
        return "not_found", "`fabric run` with no script"
    command = launched(command)[0]
    if in_process(command):
        script = cwd / command[1]
        if command[1] != "-m" and not script.is_file():
            return "not_found", f"no script {command[1]!r} in {cwd}"
        lacking = imports.lacking(needs(command, cwd))
        if lacking:  # before a rank imports anything: a wrong Python is one line, not a crash
            return ("missing_package", refusal(lacking)) if packages else None
        if command[1] == "-m" and not imports.found(command[2]):  # its package is here: the module is not
            return "not_found", f"no module {command[2]!r} for `python -m` (sys.path: the image's Python)"
        return None
    if shutil.which(command[0], path=os.environ.get("PATH")) is None and not (cwd / command[0]).is_file():
        return "not_found", f"no command {command[0]!r} on PATH or in {cwd}"
    return None


def workdir(manifest: RunManifest) -> Path:
    """Where the program runs: the directory ``runner submit`` ran in (as sbatch does), if it exists here."""
    cwd = Path(manifest.get("cwd") or os.getcwd())
    return cwd if cwd.is_dir() else Path.cwd()


def venv_on_path() -> None:
    """In a virtual environment, its ``bin`` leads PATH for the program, as after ``activate``: the tools installed
    with the program's packages (ESPnet3's recipes call some by name) are found, and so is this ``python``."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if sys.prefix != sys.base_prefix and path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = os.pathsep.join(p for p in (bindir, path) if p)


def prepare(rd: RunDir, command: list[str], manifest: RunManifest, rank: int, packages: bool) -> int | None:
    """Before the preflight: into the program's working directory; EXIT_PROGRAM with one line (and a ledger entry)
    when the command cannot start. ``packages``: look up the packages it imports here, where no preflight will
    (``preflight.runs``)."""
    os.chdir(workdir(manifest))
    venv_on_path()
    found = problem(command, Path.cwd(), packages)
    if found is None:
        return None
    reason, why = found
    log.error("program: %s. hint: %s", why, HINTS[reason])
    if rank == 0:
        rd.record("program_error", reason=reason, detail=why)
    return EXIT_PROGRAM


GROUP = "lightning.pytorch.callbacks_factory"
FACTORY = "runner.job.program_entry:factory"  # runner's entry point in GROUP (pyproject.toml declares it)


def entry_point(rd: RunDir) -> None:
    """Make runner's callback factory findable by Lightning in this process and its children.

    Installed with pip, runner's package metadata declares the entry point. Copied into an image as a directory on
    PYTHONPATH (``container.code``), it has no metadata: a small ``*.dist-info`` folder in the run directory, put on
    sys.path and PYTHONPATH, declares it then (importlib.metadata reads such folders on every path entry)."""
    from importlib.metadata import entry_points

    if any(e.value == FACTORY for e in entry_points(group=GROUP)):
        return
    where = rd.python
    info = where / "runner_program_callback-1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: runner-program-callback\nVersion: 1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nrunner = {FACTORY}\n")
    sys.path.append(str(where))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(where)) if p)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


def _run_here(command: list[str], cwd: Path) -> int:
    module = command[1] == "-m"
    sys.argv = [command[2], *command[3:]] if module else command[1:]
    # What the interpreter puts first on sys.path: the working directory for -m, the script's own for a script.
    sys.path.insert(0, str(cwd if module else (cwd / command[1]).parent.resolve()))
    try:
        if module:
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(cwd / command[1]), run_name="__main__")
    except SystemExit as e:
        return _exit_code(e.code)
    return 0


def _owner_fds() -> tuple[int, ...]:
    """A local run's owner lock, open in this rank (``OWNER_FD_ENV``): handed to the program's process, so that the
    run stays owned (``runner resume`` refused) while the program or anything it started lives."""
    fd = os.environ.get(OWNER_FD_ENV, "")
    try:
        return (int(fd),) if fd.isdigit() and os.fstat(int(fd)) else ()
    except OSError:
        return ()


def _run_child(command: list[str], cwd: Path, signals: list[int], flag: StopFlag) -> int:
    child = subprocess.Popen(command, cwd=cwd, pass_fds=_owner_fds())  # noqa: S603 -- the user's own command

    def forward(signum: int, frame: Any) -> None:  # the program's meaning, as in this process (``stopflag``)
        if signum == signal.SIGINT:
            flag.interrupted = True
        else:
            flag.signum = signum
        child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    for sig in signals:
        signal.signal(sig, forward)
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def run(rd: RunDir, cfg: RunConfig, command: list[str], ranks: tuple[int, int, int, int], attempt: int) -> int:
    """Run the program as this rank; the launcher's exit code."""
    rank, local, node, world = ranks
    # torchrun's variables (the local driver set them already; under srun they are mapped from Slurm's task ids),
    # without TORCHELASTIC_RUN_ID under srun: there Lightning and Fabric read Slurm's (``world.rank_env``).
    os.environ.update(rank_env(rank, local, node, world, cfg["num_device"], attempt=attempt,
                               max_restarts=cfg["resume"]["max_restarts"],
                               run_id=None if jobenv.current().under_slurm else rd.name, inherited=os.environ))
    command, fabric = launched(command)
    os.environ.update(fabric)
    os.environ[jobenv.PROGRAM_ENV] = str(rd.root)
    entry_point(rd)
    cwd = Path.cwd()  # the program's (``prepare``)
    random.seed(cfg["seed"] + rank)  # per-rank seeds for a program that sets none (one that does wins)
    import numpy as np
    import torch

    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"] + rank)
    here = in_process(command)
    flag = stop_flag(cfg["slurm"]["signal"])
    if stopped(rd, flag, attempt):
        log.info("a stop came before the program started: exit %d (requeue)", EXIT_REQUEUE)
        return EXIT_REQUEUE
    flag.for_program()
    steps = stephook.install(rd, cfg, flag, rank, world)
    log.info("program: %s (%s, in %s)", " ".join(command), "in this process" if here else "a child process", cwd)
    try:
        if here:
            code = _run_here(command, cwd)
        else:
            code = _run_child(command, cwd, [getattr(signal, f"SIG{cfg['slurm']['signal']}"), signal.SIGTERM,
                                             signal.SIGINT], flag)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except Exception as e:  # the traceback reaches the log; a crash in the program's own code is recorded too
        if stopped(rd, flag, attempt):  # e.g. a collective whose peers already stopped
            log.info("the program ended with %s: %s after a stop signal", type(e).__name__, e)
            code = 1
        else:
            if not rd.crash_file(attempt, rank).exists():
                outcome.record_crash(rd, attempt, rank, _last_step(), e)
            raise
    finally:
        steps.remove()
    if stopped(rd, flag, attempt) and code not in KEPT:
        log.info("the program exited %d after a stop signal: exit %d (%s)", code, EXIT_REQUEUE,
                 "interrupted" if flag.interrupted else "requeue")
        return EXIT_REQUEUE
    return conclude(rd, code, rd.program_outcome_record(attempt, rank), rank)


# runner's own exit codes, which a program's Lightning fit returns through runner's callback: kept after a stop
KEPT = (EXIT_REQUEUE, rundir.EXIT_PREFLIGHT, rundir.EXIT_SUPERSEDED, rundir.EXIT_HANG, rundir.EXIT_NONFINITE,
        EXIT_PROGRAM)


def stopped(rd: RunDir, flag: StopFlag, attempt: int) -> bool:
    """Whether this attempt was asked to stop: a signal this process got (``flag``), one announced to the ranks
    (a program's own handler took it; ``RunDir.announce_signal``), or ``runner cancel``."""
    return flag.stopped or rd.pending_signal(attempt).exists() or rd.cancelled.exists()


def conclude(rd: RunDir, code: int, fit: ProgramOutcome | None, rank: int) -> int:
    """The exit code from the program's own and what its fit did (``fit``: None when no Trainer of the program
    carried runner's callback through a fit)."""
    if code != 0:
        log.info("the program exited %d", code)
        return code
    if fit is None:
        return _plain_end(rd, rank)
    step = fit["step"]
    if step == 0 and not fit["resumed"]:
        why = "the program exited 0 without training a step (an empty data loader? max_steps=0?)"
        log.error("program: %s. hint: check its data and its Trainer's limits", why)
        if rank == 0:
            rd.record("program_error", reason="no_training", detail=why)
        return EXIT_PROGRAM
    if rank == 0:
        outcome.finished(rd, step, fit["productive_s"])
    log.info("finished at step %d", step)
    return 0


def _seen() -> tuple[int | None, float | None] | None:
    """What runner saw of the program's steps (``runner.steps.seen``); None where it saw none."""
    steps = sys.modules.get("runner.steps")  # imported by name: runner.steps imports job code (stephook does too)
    return steps.seen() if steps is not None else None


def _last_step() -> int | None:
    """The last of the program's steps runner saw (``runner.progress``, its optimizer steps); None where it saw
    none: a stage that trains nothing has no step to name."""
    seen = _seen()
    return None if seen is None else seen[0]


def _plain_end(rd: RunDir, rank: int) -> int:
    """A program that exited 0 with no Lightning fit: ``finished`` with its last step and productive seconds where
    runner saw its steps (``runner.progress``, or its optimizer steps through ``stephook``); where it saw none, the
    marker has no step and the rank log says what did not apply."""
    seen = _seen()
    if seen is None:
        # Said, not warned: a stage that trains nothing (ESPnet3's create_dataset, infer, measure) ends this way.
        log.info("the program exited 0 and runner saw none of its steps (no Lightning Trainer with runner's "
                 "callback, no runner.progress, no optimizer step): the hang watchdog, step timings and "
                 "goodput did not apply")
        if rank == 0:
            outcome.finished(rd, None, lightning=False)
        return 0
    step, productive = seen
    if rank == 0:
        outcome.finished(rd, step, productive, lightning=False)
        log.info("finished at step %s, the last of the program's steps runner saw (%s)", step,
                 "one step: no productive time" if productive is None else f"{productive:.1f} s productive")
    return 0
