"""Plan a submission as a value, then execute it (TorchX's ``schedule(submit_dryrun(...))``).

It runs on the login node. ``plan()`` touches nothing: ``runner submit --dry-run`` prints exactly what
``execute()`` would write and run. A local run starts its ranks here and waits for them.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from runner import __version__, alerts, policy, spec
from runner.errors import SubmitError
from runner.host import build, nodes, render, scheduler
from runner.host.provenance import git_provenance
from runner.records import DataModule, GitState, RunManifest, SweepMark
from runner.rundir import RunDir, atomic_write, manifest_text
from runner.spec import program_copy
from runner.spec.load import fill_builtins
from runner.spec.typed import read_resolved

if TYPE_CHECKING:
    from runner.host.background import Driver

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything a submission writes and runs."""

    run: RunDir
    files: dict[str, str]
    argv: list[str]
    scheduler: str
    world_size: int
    notes: list[str] = field(default_factory=list)
    image_problem: str | None = None
    private: dict[str, str] = field(default_factory=dict)  # written mode 0600, never printed (the git diff)
    warnings: list[str] = field(default_factory=list)  # the config's notes (validation), said at submit too
    # plan()'s arguments: to plan again under a free name (the sweep's point keeps its mark)
    source: tuple[Path, list[str], bool, SweepMark | None] | None = None

    def __str__(self) -> str:
        lines = [f"run directory: {self.run.root}", f"scheduler:     {self.scheduler}",
                 f"world size:    {self.world_size}", f"command:       {' '.join(self.argv)}", *self.notes]
        lines += [f"private file:  {name} (mode 0600, {len(text)} bytes, not shown)" for name, text in
                  self.private.items()]
        for name, text in self.files.items():
            lines += ["", f"--- {name} ---", text.rstrip("\n")]
        return "\n".join(lines)


def new_run_dir(cfg: spec.Config, taken: Collection[Path] = ()) -> RunDir:
    """The next free run directory name, ``NAME-YYYYmmdd-HHMMSS`` then ``-2``, ``-3``, ... within one second.

    Free when planned (and not in ``taken``: the names a sweep's earlier points were planned under); ``write`` claims
    it with an atomic mkdir and plans again under the next name when another submit took it in between."""
    return RunDir(free_dir(Path(cfg.data["run_root"]).resolve(), cfg.name, taken, "run directory"))


def free_dir(parent: Path, name: str, taken: Collection[Path], what: str) -> Path:
    """``parent/NAME-YYYYmmdd-HHMMSS``, then ``-2``, ...: the first that neither exists nor is in ``taken``; refused
    where sbatch could not read it in an #SBATCH line (``what`` names it in the error)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = parent / f"{name}-{stamp}"
    n = 1
    while os.path.lexists(root) or root in taken:
        n += 1
        root = root.with_name(f"{name}-{stamp}-{n}")
    if not spec.SBATCH_SAFE.match(str(root)):
        raise SubmitError(f"{what} {root}: found characters sbatch cannot read in #SBATCH lines; expected a "
                          "path of letters, digits and _.-/ hint: set run_root to such a path")
    return root


def data_module(cfg: spec.Config) -> DataModule:
    """What the manifest says about the data module: whether runner's ``dataloader`` settings reach it."""
    if cfg.program_mode:
        return {"target": None, "takes_dataloader": None, "global_batch": "the program's own"}
    takes = cfg.takes_dataloader
    return {"target": cfg.data["data"]["_target_"], "takes_dataloader": takes,
            "global_batch": cfg.global_batch if takes is not False else "the data module's own"}


def check_image(cfg: spec.Config, image: str, allow_missing: bool = False) -> str | None:
    """Why this config's image cannot be used (missing, or built from a different spec), or None.

    Only a Slurm run uses the image (a local run starts the launcher here). ``execute`` refuses to submit
    when there is a problem; ``--dry-run`` shows it. ``--allow-missing-image`` or
    ``container.allow_missing_image: true`` turn the check off (an image that exists only on the cluster).
    """
    if not scheduler.of(cfg.data["scheduler"]).uses_image(cfg) or allow_missing or \
            cfg.data["container"]["allow_missing_image"]:
        return None
    problem = build.image_problem(cfg, image)
    if problem is None:
        return None
    return (f"{problem}. hint: run `runner build {cfg.path}` first, or pass --allow-missing-image "
            "(container.allow_missing_image: true) if the image exists where the job runs")


def _spec_hash(cfg: spec.Config) -> str | None:
    """The image spec a Slurm run in a container trains with (the job checks its image against it)."""
    if render.image_kind(cfg) == "none":
        return None
    return render.spec_hash(cfg, build.image_code_files(cfg))


@dataclass(frozen=True)
class Facts:
    """Everything a submission's plan is made of that the system answers: gathered once, first (``gather``), so
    that ``make`` is a function of these alone and every plan can be tested as a value."""

    cfg: spec.Config  # loaded with the run directory's name
    run: RunDir  # a free name when gathered (``claim`` takes it)
    image: str
    image_problem: str | None  # podman's or the image file's answer (``check_image``)
    spec_hash: str | None  # of the image's spec and the code files copied into it
    git: GitState  # the config's provenance, without the diff
    diff: str  # only ever written to a private file
    secrets: list[str]  # the alert URL, to redact wherever it would land
    bad_nodes: list[str]  # the nodes the run root remembers as bad, oldest first (a Slurm job leaves them out)
    host: str
    cwd: str  # where a program (command:) runs, as sbatch runs a job where it was submitted
    now: float
    slurm_version: tuple[int, int] | None = None  # the site's (sbatch --version): --requeue=expedite where it has it


@dataclass(frozen=True)
class Context:
    """The facts every submission of one config from this process shares: its checkout's git state, this host, this
    directory, the clock (a sweep asks once for all its points)."""

    git: GitState
    diff: str
    host: str
    cwd: str
    now: float


def context(path: Path) -> Context:
    git, diff = git_provenance(path.resolve().parent)  # the diff only in a private file: it may hold a token
    return Context(git, diff, socket.gethostname(), os.getcwd(), time.time())


def gather(path: Path, overrides: list[str], allow_missing_image: bool = False, shared: Context | None = None,
           taken: Collection[Path] = (), loaded: spec.Config | None = None) -> Facts:
    """Ask the system what the plan needs: the config (loaded again with the free run directory's name, which
    ``${run_dir}`` may name), the image, git, the alert URL, the remembered bad nodes, the clock. A sweep passes what
    it asked once for every point (``shared``), the run directories its earlier points were planned under (``taken``)
    and the point's config as it checked it (``loaded``)."""
    run = new_run_dir(loaded or spec.load(path, overrides), taken)
    cfg = spec.load(path, overrides, run_dir=str(run.root))
    ctx = shared or context(path)
    bad = nodes.remembered(run.root.parent, cfg.data["resume"]["exclude_nodes_s"]) \
        if scheduler.of(cfg.data["scheduler"]).queue else {}
    image = build.image_path(cfg)
    return Facts(cfg, run, image, check_image(cfg, image, allow_missing_image), _spec_hash(cfg), ctx.git, ctx.diff,
                 alerts.secrets_of(cfg.data["alerts"]), [n for n, _ in sorted(bad.items(), key=lambda kv: (
                     kv[1]["time"], kv[0]))], ctx.host, ctx.cwd, ctx.now,
                 scheduler.of(cfg.data["scheduler"]).slurm_version())


def plan(path: Path, overrides: list[str], allow_missing_image: bool = False, sweep: SweepMark | None = None,
         shared: Context | None = None, taken: Collection[Path] = (), loaded: spec.Config | None = None) -> Plan:
    """Validate and render everything for a submission, without changing anything (``--dry-run`` prints it).
    ``sweep``: the sweep this run is a point of (its manifest says so); the rest: see ``gather``."""
    return make(gather(path, overrides, allow_missing_image, shared, taken, loaded), path, overrides,
                allow_missing_image, sweep)


def stage(command: Any) -> str | None:
    """The recipe stage(s) a program's command runs, as ESPnet3's ``run.py --stages a b`` names them ("a b"); None
    for a command that names none (runner's own training, a plain script)."""
    if not isinstance(command, list) or "--stages" not in command:
        return None
    words = command[command.index("--stages") + 1:]
    named = [str(w) for w in words[:next((i for i, w in enumerate(words) if str(w).startswith("-")), len(words))]]
    return " ".join(named) or None


def make(f: Facts, path: Path, overrides: list[str], allow_missing_image: bool = False,
         sweep: SweepMark | None = None) -> Plan:
    """The plan from its facts alone: the run directory's files, the command that starts the run and every other
    command the submission may run, and what the dry run says about them."""
    cfg, run = f.cfg, f.run
    sched = scheduler.of(cfg.data["scheduler"])  # what it would refuse, spec.load refused (validate says it too)
    manifest: RunManifest = {
        "runner_version": __version__, "config_hash": cfg.hash(), "config_file": str(path.resolve()),
        "overrides": overrides, "scheduler": cfg.data["scheduler"], "image": f.image,
        "runtime": cfg.data["container"]["runtime"], "spec_hash": f.spec_hash, "world_size": cfg.world_size,
        "global_batch": cfg.global_batch, "accumulate_grad_batches": cfg.accumulate, "git": f.git,
        "created": f.now, "host": f.host, "data_module": data_module(cfg), "cwd": f.cwd}
    if sweep is not None:
        manifest["sweep"] = sweep
    if (named := stage(cfg.data.get("command"))) is not None:
        manifest["stage"] = named
    files = {run.config.name: spec.dump(cfg.data),  # named relative to the run directory, by RunDir
             run.manifest.name: manifest_text(cast(RunManifest, alerts.redact_obj(manifest, f.secrets))),
             run.script.name: render.sbatch(cfg, run.root, f.image, f.cwd, f.slurm_version)}
    if cfg.document is not None:  # program mode: the program's config, ${program_config} in the command
        python = render.program_python(cfg, run.root, f.image, f.cwd)
        files[str(run.program_config(cfg.path.name).relative_to(run.root))] = \
            spec.dump(fill_builtins(cfg.document, {"container_python": python}))
    start = sched.launch(run, cfg, f.bad_nodes)
    notes = [f"global batch:  {cfg.global_batch} = {cfg.local_batch} x {cfg.world_size} ranks x "
             f"{cfg.accumulate} accumulation" if cfg.takes_dataloader is not False else
             "global batch:  the data module's own (it does not take runner's dataloader settings)"]
    if cfg.data["command"] is not None:
        copy = ", resolved: runner's keys left out, ${...} filled in" \
            if cfg.data["program_copy"] == program_copy.RESOLVED else ""
        notes = [f"program:       {shlex.join(cfg.data['command'])} (on every rank; its config: "
                 f"program/{cfg.path.name}{copy})", "global batch:  the program's own"]
    notes += start.notes
    notes += [f"may also run:  {shlex.join(argv)}  ({why})" for argv, why in start.also]
    if f.image_problem:
        notes.append(f"image check:   {f.image_problem} (runner submit refuses without --allow-missing-image)")
    notes += [f"note:          {n}" for n in cfg.notes]
    private = {run.git_diff.name: alerts.redact(f.diff, f.secrets)} if f.diff else {}
    if hidden := render.secret_env_file(cfg.data["env"]):
        private[run.secret_env.name] = hidden  # what the script sources: the one place an env: secret is written
    files = {name: alerts.redact(text) for name, text in files.items()}  # --dry-run prints them
    return Plan(run, files, start.argv, cfg.data["scheduler"], cfg.world_size, notes, f.image_problem,
                private=private, warnings=cfg.notes, source=(path, list(overrides), allow_missing_image, sweep))


CLAIM_TRIES = 100  # submits of one name within one second that may race for the next free suffix


def claim(p: Plan) -> Plan:
    """Create the plan's run directory atomically (mkdir); where another submit created it first, plan again under
    the next free name. Returns the plan whose directory is now this process's alone."""
    for _ in range(CLAIM_TRIES):
        p.run.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.run.root.mkdir()
            return p
        except FileExistsError:
            if p.source is None:
                break
            p = plan(*p.source)
    raise SubmitError(f"run directory {p.run.root}: found it taken by another submit after {CLAIM_TRIES} tries; "
                      "expected a free name. hint: submit again")


def write(p: Plan) -> Plan:
    """Claim the run directory and write the plan's files into it; returns the plan written (see ``claim``)."""
    p = claim(p)
    for sub in (p.run.logs, p.run.checkpoints):
        sub.mkdir()
    for name, text in p.files.items():
        (p.run.root / name).parent.mkdir(exist_ok=True)
        atomic_write(p.run.root / name, text)
    for name, text in p.private.items():
        atomic_write(p.run.root / name, text, mode=0o600, scrub=False)  # mode 0600 from the first byte
    p.run.script.chmod(0o755)
    return p


def warn(p: Plan) -> None:
    """Say the config's notes (what validation noticed) before the run starts, as ``runner validate`` says them."""
    for note in p.warnings:
        logging.getLogger("runner.spec").warning("%s", note)


@dataclass
class Started:
    """A written run that its scheduler started: the exit code for the CLI, and a local run's driver where it runs in
    the background (``start(detach=True)``; None where the run ended before ``start`` returned, or went to Slurm)."""

    run: RunDir
    code: int
    driver: Driver | None = None


def start(p: Plan, detach: bool = False) -> Started:
    """Write the run directory and start the run under its scheduler. ``detach``: a local run's driver runs in a
    process of its own (``runner.host.background``) and this returns once the run recorded its start; else a local run
    is driven here, in the foreground, until its attempt ends (``runner submit``)."""
    if p.image_problem:
        raise SubmitError(p.image_problem)
    p = write(p)
    sched = scheduler.of(p.scheduler)
    if detach and not sched.detached:
        from runner.host import background

        return Started(p.run, 0, background.start(p.run, p.world_size))
    return Started(p.run, sched.start(p.run, p.world_size))


def execute(p: Plan) -> int:
    """Write the run directory and start the run under its scheduler; returns the exit code for the CLI."""
    return start(p).code


RESIZABLE = ("num_nodes", "num_device")


def _whole(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)


@dataclass
class ProgramLayout:
    """What a resize writes for a program: its config (``path``, new ``config``) and its accumulation before/after."""

    path: Path
    config: dict[str, Any]
    accumulate: tuple[int, int]


def _program_layout(run: RunDir, before: spec.Config, overrides: list[str], world: int) -> ProgramLayout:
    """Program mode: the new layout written into the program's own config (``${program_config}``), the one place
    the program reads it, with ``trainer.accumulate_grad_batches`` re-derived so that every optimizer step still
    takes as many rank-batches (ESPnet3's per-rank batches: its global batch kept). A program that does not read
    its config, or whose accumulation is not a number there, is refused: runner cannot keep its global batch."""
    configs = sorted((run.root / "program").glob("*"))
    hint = "hint: submit the config again with the new layout"
    if len(configs) != 1 or not any(str(configs[0]) in arg for arg in before.data["command"] or ()):
        raise SubmitError(f"resume {run.name}: found a program that does not read ${{program_config}}; expected "
                          f"one that does, so that runner can write the new layout where it reads it. {hint}")
    doc = yaml.safe_load(configs[0].read_text())
    # resolved (LightningCLI): runner's keys left out, trainer.devices/num_nodes integers; its command cannot carry
    # the layout (spec.program_copy refuses it), so only the as-written copy, which keeps the command, is checked
    resolved = before.data.get(program_copy.KEY) == program_copy.RESOLVED
    if not resolved and isinstance(doc, dict) and program_copy.LAYOUT.search(str(doc.get("command"))):
        raise SubmitError(f"resume {run.name}: found num_nodes or num_device in the command line; expected them "
                          f"only in the program's config, which runner rewrites. {hint}")
    trainer = doc.get("trainer") if isinstance(doc, dict) else None
    if not isinstance(trainer, dict):
        raise SubmitError(f"resume {run.name}: found no trainer: mapping in {configs[0]}; expected the program's "
                          f"Lightning Trainer settings. {hint}")
    acc = trainer.get("accumulate_grad_batches", 1)
    if not _whole(acc):
        raise SubmitError(f"resume {run.name}: found trainer.accumulate_grad_batches={acc!r} in the program's "
                          f"config; expected a number runner can derive again. {hint}")
    steps = before.world_size * acc  # rank-batches per optimizer step
    if steps % world:
        raise SubmitError(f"resume {run.name}: found {world} ranks for {steps} rank-batches per optimizer step "
                          f"({before.world_size} ranks x accumulation {acc}); expected a world size that divides "
                          f"{steps}, to keep the global batch. hint: "
                          f"{' or '.join(str(w) for w in range(1, steps + 1) if steps % w == 0)} ranks")
    trainer["accumulate_grad_batches"] = steps // world
    if resolved:  # the layout is in trainer: alone, as integers (no num_nodes/num_device at its top)
        layout: dict[str, Any] = {"num_nodes": before.data["num_nodes"], "num_device": before.data["num_device"]}
        spec.apply_overrides(layout, overrides)
        trainer.update(devices=layout["num_device"], num_nodes=layout["num_nodes"])
    else:
        spec.apply_overrides(doc, overrides)
        for key, value in (("devices", doc.get("num_device")), ("num_nodes", doc.get("num_nodes"))):
            if _whole(trainer.get(key)):  # ESPnet3 writes ${num_device}: the program resolves that itself
                trainer[key] = value
    for loader in (doc.get("dataloader") or {}).values():
        if isinstance(loader, dict) and _whole(loader.get("dist_world_size")):
            loader["dist_world_size"] = world
    return ProgramLayout(configs[0], doc, (acc, steps // world))


def resize(run: RunDir, overrides: list[str]) -> str:
    """Change a stopped run's node or device count, keeping its global batch; returns what changed.

    Only the layout may change: anything else would be another config (a new run). With a target
    ``global_batch_size`` the accumulation is derived again, so the config hash (which leaves the layout
    out) stays the same and the run resumes from its checkpoints.
    """
    bad = sorted({o.partition("=")[0] for o in overrides} - set(RESIZABLE))
    if bad:
        raise SubmitError(f"resume {run.name}: found an override of {', '.join(bad)}; expected only num_nodes or "
                          "num_device. hint: another config is another run: runner submit")
    data: dict[str, Any] = yaml.safe_load(run.config.read_text())  # raw: it is edited, then validated
    before = spec.from_dict(copy.deepcopy(data), run.config)
    spec.apply_overrides(data, overrides)
    world = data["num_nodes"] * data["num_device"] if _whole(data["num_nodes"], data["num_device"]) else None
    program = _program_layout(run, before, overrides, world) if before.program_mode and world else None
    data["trainer"].update(devices=data["num_device"], num_nodes=data["num_nodes"])
    for split in data["dataloader"].values():
        if isinstance(split, dict) and (not before.program_mode or "dist_world_size" in split):
            split["dist_world_size"] = world
    if program is not None:
        data["trainer"]["accumulate_grad_batches"] = program.accumulate[1]
    if data.get("global_batch_size"):
        data["trainer"]["accumulate_grad_batches"] = None
    staged = run.root / ".config.resize.yaml"
    atomic_write(staged, spec.dump(data))
    try:
        after = spec.load(staged, files=False)
    finally:
        staged.unlink(missing_ok=True)
    manifest = run.manifest_record() or {}  # {} when damaged (said in one line): the resize rewrites it
    if after.hash() != before.hash() and not data["resume"]["force"]:  # one hash rule for both, whatever wrote it
        raise SubmitError(f"resume {run.name}: the new layout changes the global batch ({before.global_batch} -> "
                          f"{after.global_batch}); expected the same. hint: set global_batch_size in the config")
    atomic_write(run.config, spec.dump(after.data))
    if program is not None:
        atomic_write(program.path, spec.dump(program.config))
    atomic_write(run.script, render.sbatch(after, run.root, manifest.get("image", "none"), manifest.get("cwd"),
                                           scheduler.of(after.data["scheduler"]).slurm_version()))
    acc = program.accumulate if program is not None else (before.accumulate, after.accumulate)
    manifest["world_size"], manifest["accumulate_grad_batches"] = after.world_size, acc[1]
    run.write_manifest(manifest)
    b, a = before.data, after.data
    kept = (f"{before.world_size * program.accumulate[0]} rank-batches per optimizer step kept (the program's "
            "trainer.accumulate_grad_batches, in its config)") if program is not None \
        else f"global batch {after.global_batch} kept"
    change = (f"resized from {b['num_nodes']}x{b['num_device']} (accumulate {acc[0]}) to "
              f"{a['num_nodes']}x{a['num_device']} (accumulate {acc[1]}); {kept}")
    run.record("resized", change=change, world_size=after.world_size, accumulate=acc[1])
    print(change)
    return change


def _refuse_damaged(run: RunDir) -> None:
    """What every rank of a resumed attempt reads or writes first, checked before one starts: a damaged manifest
    would crash each rank at once (and its message would advise resuming again), a ``logs`` that is a file would
    crash the launcher."""
    if run.manifest_record() is None:
        raise SubmitError(f"resume {run.name}: {run.manifest} is missing or unreadable (not the JSON object runner "
                          "submit wrote); expected the run's manifest, which every rank reads. hint: restore it, or "
                          f"submit the config again: runner submit {run.config}")
    if run.logs.exists() and not run.logs.is_dir():
        raise SubmitError(f"resume {run.name}: {run.logs} is a file; expected a directory (each attempt's rank logs "
                          "go there). hint: move the file away")


def resume_any(run: RunDir, overrides: list[str], force: bool = False) -> int:
    """``runner resume``: a training run from its newest complete checkpoint (``resume``), a ``runner parallel`` run
    from its own config (its done items kept)."""
    from runner.host import status

    if status.is_parallel(run):
        from runner.host import parallel

        return parallel.resume(run, overrides)
    return resume(run, overrides, force=force)


def resume(run: RunDir, overrides: list[str] | None = None, force: bool = False) -> int:
    """Start a stopped run again in its own directory; the launcher picks the newest complete checkpoint.

    Never while the run's job may be alive (one job trains a run at a time): a job Slurm reports pending or
    running is refused; ``force`` only overrides "Slurm cannot be asked" (see ``policy.resume_action``).
    """
    if not run.config.is_file():
        raise SubmitError(f"{run.root}: found no config.yaml; expected a run directory. hint: see `runner status`")
    _refuse_damaged(run)
    from runner.host import observe

    seen = observe.observe(run, observe.resumable)
    decision = policy.resume_action(seen.records, seen.job, seen.asked, force, seen.heir)
    if decision.action == "refuse":
        raise SubmitError(f"resume {run.name}: {decision.reason}")
    if decision.action == "skip":
        print(f"run {run.root} {decision.reason}")
        return 0
    sched = scheduler.of(seen.config["scheduler"])
    owner = sched.hold(run)  # a local run: one trainer per run directory, refused while one lives
    change = resize(run, overrides) if overrides else None
    cfg = read_resolved(run.config)
    run.cancelled.unlink(missing_ok=True)  # resuming is the user's word: a cancel before it no longer holds
    return sched.restart(run, cfg, change or decision.reason, owner)
