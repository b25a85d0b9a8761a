"""Plan and run image builds: docker or podman builds the image, Apptainer turns it into a SIF.

``plan()`` renders everything in memory and decides which steps are needed; it changes nothing, so
``runner build --dry-run`` prints exactly the commands that ``execute()`` runs. The steps are:

1. ``image``:   ``docker|podman build`` of the rendered Dockerfile (``--build-arg BASE_IMAGE=...``).
2. ``freeze``:  ``pip freeze`` run inside the built image.
3. ``base``:    ``image inspect`` of the base image, for its digest.
4. ``label``:   a one-line build ``FROM`` the image that only adds the provenance labels, so that the
                Dockerfile (and with it the layer cache) does not change with every commit.
5. ``save``:    ``save`` as an archive (``IMAGE_DIR/<name>-<hash>.tar``) for Apptainer: podman's an oci-archive,
                docker's a docker-archive (Apptainer reads an OCI archive's layers as they are; a docker-archive's it
                first recompresses into a layout of its own, 2.3x the time for a 5 GB image, BENCHMARKS.md).
6. ``sif``:     ``apptainer build --force --disable-cache IMAGE.sif apptainer.def`` (``Bootstrap:`` the archive's
                format; ``container.sif_compression`` picks mksquashfs's compressor),
                whose ``%labels`` carry the same provenance. Once the SIF is built the archive, a second copy of the
                image as large as it, is removed; so are Apptainer's layer cache entries (``--disable-cache``: a
                local archive gains nothing from a cache that would hold a third copy of every layer).

Values that exist only after a step ran (the pip freeze, the base digest) appear in the plan as
``@{pip_freeze}`` and ``@{base_digest}`` and are filled in when the step before has run.

Everything lands next to the SIF named by ``image_path`` (which ``runner submit`` uses too): the build directory
``IMAGE_DIR/build/<name>-<hash>/`` (Dockerfile, apptainer.def, code/, spec.json, logs/, image.json)
and ``<name>-<hash>.json``, the provenance record, written last: it marks a complete build.

Without Apptainer (a workstation with docker, a login node without it) the build stops after
``save`` with exit 0 and a note: the archive is the deliverable, and the note prints the
command to run where Apptainer is. A later ``runner build`` where Apptainer exists runs only ``sif``.

Runs on the login node (or a workstation); nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from runner import __version__, proc, spec
from runner.errors import BuildError
from runner.host import render
from runner.host.provenance import git_provenance
from runner.records import GitState
from runner.rundir import RunDir, atomic_write, read_json
from runner.spec import Config

LABEL_PREFIX = "runner."
# Filled in from the output of earlier steps; everything else in a plan is literal.
PLACEHOLDER = re.compile(r"@\{(pip_freeze|base_digest)\}")
PROVENANCE_DOCKERFILE = """\
# Adds the provenance labels (passed as --label) to an image built from the Dockerfile next to this one.
ARG IMAGE
FROM ${IMAGE}
"""
TAIL_LINES = 20
# Generous limits, so that only a hung step is stopped: an NGC image with nccl-tests builds in ~15 min on a
# login node, and saving or converting a 20 GB image takes minutes.
BUILD_TIMEOUT_S = 3 * 3600
SAVE_TIMEOUT_S = 3600


def image_code_files(cfg: Config) -> dict[str, bytes]:
    """The files copied into the image (relative name -> content), for the spec hash and the build context.

    Not the code the preflight compares between nodes (``runner.checks.code_to_compare``).
    """
    import runner
    from runner.spec.validate import escapes

    out: dict[str, bytes] = {}
    base = Path(cfg.path).resolve().parent
    for entry in cfg.data["container"]["code"]:
        src = Path(runner.__file__).resolve().parent if entry == "runner" else (base / entry)
        if entry != "runner" and (outside := escapes(base, src)) is not None:  # linked since it was validated
            raise BuildError(f"container.code: {entry}: {outside} leads outside {base}; expected the project's own "
                             "code. hint: copy that code next to the config instead of linking it")
        if src.is_file():
            out[src.name] = src.read_bytes()
            continue
        for f in sorted(src.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc",):
                out[f"{src.name}/{f.relative_to(src)}"] = f.read_bytes()
    return out


@dataclass(frozen=True)
class Paths:
    """Every path of one image build (the SIF path is the one ``runner submit`` uses)."""

    build_dir: Path
    sif: Path

    archive = property(lambda self: self.sif.with_suffix(".tar"))
    sqsh = property(lambda self: self.sif.with_suffix(".sqsh"))  # enroot's image, for pyxis
    record = property(lambda self: self.sif.with_suffix(".json"))
    logs = property(lambda self: self.build_dir / "logs")
    dockerfile = property(lambda self: self.build_dir / "Dockerfile")
    definition = property(lambda self: self.build_dir / "apptainer.def")
    provenance_dockerfile = property(lambda self: self.build_dir / "provenance.Dockerfile")


def sif_path(cfg: Config, spec_hash: str) -> Path:
    """The one place that names a config's SIF: ``container.image``, else ``IMAGE_DIR/<name>-<spec hash>.sif``."""
    c = cfg.data["container"]
    if c["image"]:
        return Path(c["image"]).resolve()
    return Path(c["image_dir"]).resolve() / f"{cfg.name}-{spec_hash}.sif"


def image_path(cfg: Config) -> str:
    """The image a run of this config uses (``runner submit``), hashing the spec and the code as a build would:
    the SIF (Apptainer), the builder's tag (podman), the enroot squashfs (pyxis), or ``none``."""
    kind = render.image_kind(cfg)
    if kind == "none":
        return "none"
    h = render.spec_hash(cfg, image_code_files(cfg))
    if kind == "tag":
        return image_tag(cfg, h)
    sif = sif_path(cfg, h)
    return str(sif.with_suffix(".sqsh") if kind == "sqsh" else sif)


def paths(cfg: Config, spec_hash: str) -> Paths:
    build_dir = Path(cfg.data["container"]["image_dir"]).resolve() / "build" / f"{cfg.name}-{spec_hash}"
    return Paths(build_dir=build_dir, sif=sif_path(cfg, spec_hash))


def image_tag(cfg: Config, spec_hash: str) -> str:
    """The builder's tag: repository names must be lower case, the hash says which spec it holds."""
    return f"localhost/runner-{cfg.name.lower()}:{spec_hash}"


def _docker_daemon_answers() -> bool:
    return proc.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=10, check=False).returncode == 0


def detect_builder(choice: str) -> tuple[str, str | None]:
    """(builder, problem): docker where its daemon answers, else podman; ``problem`` names what is missing."""
    if choice in ("docker", "podman"):
        if shutil.which(choice) is None:
            return choice, (f"container.builder is {choice}, but {choice} is not on PATH. hint: install it, or "
                            "set container.builder: auto to use what is there")
        return choice, None
    docker = shutil.which("docker") is not None
    if docker and _docker_daemon_answers():
        return "docker", None
    if shutil.which("podman"):
        return "podman", None
    if docker:
        return "docker", ("docker is installed but its daemon does not answer, and podman is not installed. "
                          "hint: start the docker daemon, or install podman (scripts/install-podman.sh)")
    return "podman", ("no image builder found: neither docker nor podman is on PATH. hint: install podman "
                      "(scripts/install-podman.sh) or docker")


def sif_tool(cfg: Config) -> str | None:
    """The Apptainer binary that builds the SIF (the runtime's own name first), or None if none is here."""
    runtime = cfg.data["container"]["runtime"]
    for name in (runtime, "apptainer", "singularity"):
        if name != "none" and shutil.which(name):
            return name
    return None


@dataclass
class Step:
    """One command of a build. ``capture``: its stdout is a value for later steps, not just log output."""

    name: str
    title: str
    argv: list[str]
    capture: bool = False
    timeout_s: float = 600

    def command(self, values: dict[str, str]) -> list[str]:
        return [fill(a, values) for a in self.argv]


def fill(text: str, values: dict[str, str]) -> str:
    """Replace ``@{key}`` by the value an earlier step produced (one pass: values are never re-expanded)."""
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


@dataclass
class BuildPlan:
    """Everything a build writes and runs; ``str()`` is the dry run."""

    config_name: str
    spec_hash: str
    builder: str
    tag: str
    paths: Paths
    files: dict[str, bytes]
    steps: list[Step]
    provenance: dict[str, Any]
    sif_tool: str | None
    wants_sif: bool
    wheelhouse: Path | None = None
    up_to_date: str | None = None
    problem: str | None = None
    values: dict[str, str] = field(default_factory=dict)
    previous: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sign_key: str | None = None  # container.sign_key, absolute: the key the SIF is (to be) signed with

    def __str__(self) -> str:
        lines = [f"config:      {self.config_name}", f"spec hash:   {self.spec_hash}",
                 f"builder:     {self.builder}", f"image tag:   {self.tag}",
                 f"build dir:   {self.paths.build_dir}", f"record:      {self.paths.record}"]
        if self.wants_sif:
            lines += [f"archive:     {self.paths.archive}", f"sif:         {self.paths.sif}"]
        if self.problem:
            lines.append(f"problem:     {self.problem}")
        lines += [f"note:        {n}" for n in self.notes]
        if self.up_to_date:
            lines += ["", self.up_to_date]
            return "\n".join(lines)
        code = sorted(n for n in self.files if n.startswith("code/"))
        if any(s.name == "save" for s in self.steps):
            lines += ["", f"remove {self.paths.record.name} and {self.paths.archive.name} if they exist"]
        elif any(s.name == "image" for s in self.steps):
            lines += ["", f"remove {self.paths.record.name} if it exists"]
        lines += [f"write {self.paths.build_dir}/: " + ", ".join(n for n in self.files if not n.startswith("code/"))
                  + f", code/ ({len(code)} files)"
                  + (f", wheelhouse/ (the wheels of {self.wheelhouse})" if self.wheelhouse else "")]
        for i, step in enumerate(self.steps, 1):
            lines.append(f"[{i}/{len(self.steps)}] {step.name}: {shlex.join(step.command(self.values))}")
        if any(PLACEHOLDER.search(a) for step in self.steps for a in step.command(self.values)):
            lines.append("(@{pip_freeze} and @{base_digest} are filled in from the output of steps freeze and base)")
        lines.append(f"then write {self.paths.record} (the provenance record; it marks the build complete)")
        for name in ("Dockerfile", "apptainer.def"):
            lines += ["", f"--- {name} ---", fill(self.files[name].decode(), self.values).rstrip("\n")]
        return "\n".join(lines)


def provenance(cfg: Config, spec_hash: str, base: str) -> dict[str, Any]:
    """What is known about an image before it is built: where it comes from and which code and config."""
    git, _ = git_provenance(Path(cfg.path).resolve().parent)
    return {"spec_hash": spec_hash, "base_image": base, "git_commit": git.get("commit"), "git_dirty": git.get("dirty"),
            "config_hash": cfg.hash(), "config_file": str(Path(cfg.path).resolve()), "runner_version": __version__}


def labels(prov: dict[str, Any]) -> list[tuple[str, str]]:
    """Provenance as ``runner.*`` labels; the values from earlier steps as placeholders."""
    dirty = prov["git_dirty"]
    out = [("base_image", prov["base_image"]), ("base_digest", "@{base_digest}"),
           ("git_commit", prov["git_commit"] or "unknown"),
           ("git_dirty", "unknown" if dirty is None else str(dirty).lower()),
           ("config_hash", prov["config_hash"]), ("version", prov["runner_version"]),
           ("spec_hash", prov["spec_hash"]), ("pip_freeze", "@{pip_freeze}")]
    result = [(LABEL_PREFIX + k, v) for k, v in out]
    if prov["git_commit"]:
        result.append(("org.opencontainers.image.revision", prov["git_commit"]))
    return result


def _spec_json(cfg: Config, spec_hash: str, code: dict[str, bytes]) -> bytes:
    spec = {"spec_hash": spec_hash, "spec": render.image_spec(cfg),
            "code": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(code.items())}}
    return (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode()


def _definition(cfg: Config, spec_hash: str, p: Paths, prov: dict[str, Any], builder: str) -> str:
    # %labels lines are "KEY VALUE" on one line, and Apptainer reads {{ }} as build arguments.
    safe = [(k, v.replace("\n", " ").replace("{{", "{ {").replace("}}", "} }")) for k, v in labels(prov)]
    return render.apptainer_def(cfg, spec_hash, archive_format(builder), str(p.archive), extra_labels=safe)


def archive_format(builder: str) -> str:
    """What ``save`` writes: podman an oci-archive, docker (whose ``save`` writes only this) a docker-archive."""
    return "oci-archive" if builder == "podman" else "docker-archive"


# mksquashfs's options per container.sif_compression: zstd at zstd's own default level (mksquashfs's is 15).
SQUASHFS_ARGS = {"gzip": [], "zstd": ["-comp", "zstd", "-Xcompression-level", "3"]}


def _steps(builder: str, sif: str | None, tag: str, base: str, p: Paths, python: str, prov: dict[str, Any],
           save: bool, sign_key: str | None = None, compression: str = "gzip") -> list[Step]:
    ctx = str(p.build_dir)
    # podman writes OCI images by default, which have no SHELL: the Dockerfile's bash -o pipefail would be lost.
    fmt = ["--format", "docker"] if builder == "podman" else []
    label_args = [a for k, v in labels(prov) for a in ("--label", f"{k}={v}")]
    steps = [
        Step("image", "build the image", [builder, "build", *fmt, "--file", str(p.dockerfile),
                                          "--build-arg", f"BASE_IMAGE={base}", "--tag", tag, ctx],
             timeout_s=BUILD_TIMEOUT_S),
        Step("freeze", "pip freeze inside the image",
             [builder, "run", "--rm", "--network=none", "--entrypoint", python, tag, "-m", "pip", "freeze"],
             capture=True, timeout_s=300),
        Step("base", "inspect the base image", [builder, "image", "inspect", base], capture=True, timeout_s=120),
        Step("label", "add the provenance labels", [builder, "build", *fmt, "--file", str(p.provenance_dockerfile),
                                                    "--build-arg", f"IMAGE={tag}", *label_args, "--tag", tag, ctx]),
    ]
    if save:
        archive_fmt = ["--format", archive_format(builder)] if builder == "podman" else []
        steps.append(Step("save", f"save the {archive_format(builder)}",
                          [builder, "save", *archive_fmt, "--output", str(p.archive), tag], timeout_s=SAVE_TIMEOUT_S))
    if sif:
        steps += sif_steps(sif, p, sign_key, compression)
    return steps


def enroot_argv(builder: str, tag: str, p: Paths) -> list[str]:
    """enroot's import of the built image into the squashfs that pyxis runs (``srun --container-image``)."""
    return ["enroot", "import", "--output", str(p.sqsh), f"{'dockerd' if builder == 'docker' else 'podman'}://{tag}"]


def sif_steps(tool: str, p: Paths, sign_key: str | None, compression: str) -> list[Step]:
    """The SIF from the definition, its ``%test`` run as a step of its own (``apptainer build`` would run it with
    every capability requested, which fails where root's bounding set lacks one; ``apptainer test`` keeps to the
    site's configuration, as the ranks will), and with ``container.sign_key`` Apptainer's signature."""
    args = SQUASHFS_ARGS[compression]
    squashfs = ["--mksquashfs-args", shlex.join(args)] if args else []
    sif = [tool, "build", "--force", "--notest", "--disable-cache", *squashfs, str(p.sif), str(p.definition)]
    steps = [Step("sif", "build the SIF", sif, timeout_s=SAVE_TIMEOUT_S),
             Step("test", "run the image's %test", [tool, "test", str(p.sif)], timeout_s=300)]
    return steps + ([sign_step(tool, p, sign_key)] if sign_key else [])


SIF_ONLY = ("sif", "test", "sign", "sqsh")  # steps that only read an image already built


def sign_step(tool: str, p: Paths, sign_key: str) -> Step:
    return Step("sign", "sign the SIF", [tool, "sign", "--key", sign_key, str(p.sif)],
                timeout_s=300)


def _builder_has(builder: str, tag: str) -> bool:
    return proc.run([builder, "image", "inspect", tag], timeout=30, check=False).returncode == 0


def plan(path: str | Path, overrides: list[str] | None = None, force: bool = False) -> BuildPlan:
    """Render the build directory in memory and decide what has to run; changes nothing."""
    return plan_config(spec.load(path, overrides or [], start=False), force)


def plan_from_run(run_dir: Path, force: bool = False) -> BuildPlan:
    """The build of the image a run was submitted with: its resolved config (``config.yaml``), with code paths
    relative to the config file it came from; refused when that no longer gives the recorded spec hash."""
    run = RunDir(run_dir)
    manifest = run.manifest_record()
    if manifest is None or not run.config.is_file():
        raise BuildError(f"{run_dir}: found no manifest.json and config.yaml; expected a run directory. "
                         "hint: see `runner status`")
    cfg = spec.load(run.config, start=False)
    cfg.path = Path(manifest.get("config_file") or cfg.path)
    bp = plan_config(cfg, force)
    want = manifest.get("spec_hash")
    if want and bp.spec_hash != want:
        git: GitState = manifest.get("git") or {}
        raise BuildError(f"{run_dir.name}: its config and today's code give spec {bp.spec_hash}; the run recorded "
                         f"spec {want}. hint: check out the run's code (git commit {git.get('commit')}, dirty: "
                         f"{git.get('dirty')}; manifest.json holds the diff) and run again")
    return bp


def plan_config(cfg: Config, force: bool = False) -> BuildPlan:
    c = cfg.data["container"]
    code = image_code_files(cfg)
    h = render.spec_hash(cfg, code)
    p = paths(cfg, h)
    tag = image_tag(cfg, h)
    base = render.base_image(cfg)
    builder, problem = detect_builder(c["builder"])
    kind = render.image_kind(cfg)
    wants_sif = kind == "sif"
    tool = sif_tool(cfg) if wants_sif else None
    prov = provenance(cfg, h, base)
    files = {"Dockerfile": render.dockerfile(cfg, h).encode(),
             "apptainer.def": _definition(cfg, h, p, prov, builder).encode(),
             "provenance.Dockerfile": PROVENANCE_DOCKERFILE.encode(),
             "spec.json": _spec_json(cfg, h, code), ".dockerignore": b"logs/\nimage.json\n"}
    files.update({f"code/{name}": data for name, data in code.items()})
    wheels = Path(c["wheelhouse"]).resolve() if c["wheelhouse"] else None
    bp = BuildPlan(cfg.name, h, builder, tag, p, files, [], prov, tool, wants_sif, wheels, problem=problem)
    record = read_json(p.record, {}) if not force else {}
    done = record.get("spec_hash") == h
    if done:  # a SIF built later from this image gets the labels recorded then
        bp.previous = record
        recorded = record.get("labels") or {}
        bp.values = {key: str(recorded[LABEL_PREFIX + key]) for key in ("pip_freeze", "base_digest")
                     if LABEL_PREFIX + key in recorded}
    missing_sif = (f"apptainer not found: the {archive_format(builder)} {p.archive} is ready for the cluster. There "
                   f"run: apptainer build {p.sif.name} {archive_format(builder)}:{p.archive.name}")
    sign_key = str(Path(c["sign_key"]).resolve()) if wants_sif and c["sign_key"] else None
    bp.sign_key = sign_key
    if done and wants_sif and p.sif.is_file() and sign_key and record.get("signed_with") != sign_key and tool:
        bp.steps = [sign_step(tool, p, sign_key)]
        bp.notes.append(f"the SIF exists for spec {h}; only its signature is added")
    elif done and wants_sif and p.sif.is_file():
        bp.up_to_date = f"image {p.sif} is up to date (spec {h}); nothing to do (--force rebuilds)"
    elif done and wants_sif and p.archive.is_file() and tool is None:
        bp.up_to_date = f"image {tag} (spec {h}) is built; nothing to do. {missing_sif}"
    elif done and wants_sif and p.archive.is_file():
        bp.steps = sif_steps(tool or "apptainer", p, sign_key, c["sif_compression"])
        bp.notes.append(f"the image and {p.archive.name} exist for spec {h}; only the SIF is built")
    elif done and kind == "sqsh" and p.sqsh.is_file():
        bp.up_to_date = f"image {p.sqsh} is up to date (spec {h}); nothing to do (--force rebuilds)"
    elif done and not wants_sif and not problem and _builder_has(builder, tag) and kind != "sqsh":
        bp.up_to_date = f"image {tag} is up to date (spec {h}); nothing to do (--force rebuilds)"
    else:
        bp.steps = _steps(builder, tool, tag, base, p, c["python"], prov, save=wants_sif, sign_key=sign_key,
                          compression=c["sif_compression"])
        if wants_sif and tool is None:
            bp.notes.append(missing_sif.replace("is ready", "will be ready"))
    if kind == "sqsh" and not bp.up_to_date:
        if done and _builder_has(builder, tag):
            bp.steps = []
        if shutil.which("enroot"):
            bp.steps.append(Step("sqsh", "import the image into an enroot squashfs (pyxis)",
                                 enroot_argv(builder, tag, p), timeout_s=SAVE_TIMEOUT_S))
        else:
            bp.notes.append(f"enroot not found: on a node with enroot run: {shlex.join(enroot_argv(builder, tag, p))}")
        if not bp.steps:
            bp.up_to_date = f"image {tag} (spec {h}) is built; nothing to do here. {bp.notes.pop()}"
    if all(s.name in SIF_ONLY for s in bp.steps):
        bp.problem = None  # the builder does not run, so a missing one does not matter
    return bp


class Progress:
    """Step lines with elapsed time; on a terminal a live line with the step's latest output."""

    def __init__(self, total: int, out: TextIO | None = None):
        self.total = total
        self.out = out or sys.stdout
        self.live = self.out.isatty()
        self.echo = bool(os.environ.get("RUNNER_VERBOSE"))
        self._last = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._label = ""

    def start(self, i: int, step: Step, log: Path) -> None:
        self._label = f"[{i}/{self.total}] {step.name}"
        self._t0 = time.monotonic()
        self._last = ""
        print(f"{self._label}: {step.title} (log: {log})", file=self.out, flush=True)
        if self.live:
            self._stop.clear()
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def line(self, text: str) -> None:
        with self._lock:
            self._last = text.strip()
            if self.echo:
                print(f"    {text.rstrip()}", file=self.out, flush=True)

    def _tick(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        while not self._stop.wait(0.5):
            with self._lock:
                text = f"    {time.monotonic() - self._t0:6.1f} s  {self._last}"
                self.out.write("\r" + text[:width].ljust(width))
                self.out.flush()

    def finish(self, ok: bool) -> float:
        seconds = time.monotonic() - self._t0
        if self._thread:
            self._stop.set()
            self._thread.join()
            self.out.write("\r" + " " * (shutil.get_terminal_size((100, 20)).columns - 1) + "\r")
        print(f"    {'done' if ok else 'FAILED'} in {seconds:.1f} s", file=self.out, flush=True)
        return seconds


def _run_step(argv: list[str], log: Path, capture: bool, progress: Progress, timeout_s: float) -> tuple[int, str]:
    """Run one step, streaming its output into ``log``; returns (exit code, captured stdout).

    A step still running after ``timeout_s`` is terminated and reported as exit 124, like timeout(1).
    Popen rather than ``proc.run``: a build runs for many minutes and its output is shown while it runs.
    """
    with open(log, "w") as logf:
        logf.write("+ " + shlex.join(argv) + "\n")
        logf.flush()
        try:
            child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=logf if capture else subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
        except FileNotFoundError:
            logf.write(f"{argv[0]}: command not found\n")
            return 127, ""
        captured: list[str] = []
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            child.terminate()

        watchdog = threading.Timer(timeout_s, stop)
        watchdog.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                logf.write(line)
                logf.flush()
                progress.line(line)
                if capture:
                    captured.append(line)
            rc = child.wait()
        except BaseException:
            child.terminate()
            child.wait()
            raise
        finally:
            watchdog.cancel()
        if expired.is_set():
            logf.write(f"runner: stopped after {timeout_s:g} s\n")
            rc = 124
    return rc, "".join(captured)


def _tail(log: Path, n: int = TAIL_LINES) -> list[str]:
    try:
        return list(deque(log.read_text(errors="replace").splitlines(), maxlen=n))
    except OSError:
        return []


def _base_digest(inspect_json: str) -> str:
    """The base image's registry digest where the builder knows one, else its local image id."""
    try:
        info = json.loads(inspect_json)[0]
    except (ValueError, IndexError, KeyError, TypeError):
        return "unknown"
    digests = info.get("RepoDigests") or []
    return str(digests[0] if digests else info.get("Digest") or info.get("Id") or "unknown")


def write_build_dir(bp: BuildPlan) -> None:
    d = bp.paths.build_dir
    shutil.rmtree(d / "code", ignore_errors=True)
    for name, data in bp.files.items():
        target = d / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    bp.paths.logs.mkdir(parents=True, exist_ok=True)
    if bp.wheelhouse:  # into the build context (a hard link where it can be: a GB of wheels)
        shutil.rmtree(d / "wheelhouse", ignore_errors=True)
        (d / "wheelhouse").mkdir()
        for wheel in sorted(bp.wheelhouse.glob("*.whl")):
            try:
                os.link(wheel, d / "wheelhouse" / wheel.name)
            except OSError:
                shutil.copyfile(wheel, d / "wheelhouse" / wheel.name)


def execute(bp: BuildPlan, out: TextIO | None = None) -> int:
    """Run the plan's steps; the provenance record is written last, so it marks a complete build."""
    out = out or sys.stdout
    if bp.up_to_date:
        print(bp.up_to_date, file=out)
        return 0
    if bp.problem:
        raise BuildError(bp.problem)
    p = bp.paths
    if any(s.name == "image" for s in bp.steps):  # a rebuild: the old record no longer describes the image
        p.record.unlink(missing_ok=True)
    if any(s.name == "save" for s in bp.steps):
        p.archive.unlink(missing_ok=True)  # podman save refuses to overwrite an archive
    write_build_dir(bp)
    print(f"runner build: {bp.config_name} spec {bp.spec_hash} with {bp.builder}; build dir {p.build_dir}",
          file=out, flush=True)
    values = dict(bp.values)
    record = dict(bp.previous) if bp.steps[0].name in SIF_ONLY else {}
    durations: dict[str, float] = dict(record.get("durations", {}))
    progress = Progress(len(bp.steps), out)
    t0 = time.monotonic()
    for i, step in enumerate(bp.steps, 1):
        log = p.logs / f"{step.name}.log"
        if step.name == "sif":  # the definition's %labels need the values of the steps before
            p.definition.write_text(fill(bp.files["apptainer.def"].decode(), values))
        progress.start(i, step, log)
        rc, stdout = _run_step(step.command(values), log, step.capture, progress, step.timeout_s)
        durations[step.name] = round(progress.finish(rc == 0), 2)
        if rc != 0:
            for line in _tail(log):
                print(f"    | {line}", file=sys.stderr)
            what = {127: "not found", 124: f"timed out after {step.timeout_s:g} s"}.get(rc, f"failed (exit {rc})")
            raise BuildError(f"build step '{step.name}' ({step.title}) {what}; log: {log}")
        if step.name == "freeze":
            freeze = [line.strip() for line in stdout.splitlines() if line.strip()]
            values["pip_freeze"] = json.dumps(freeze, separators=(",", ":"))
            record["pip_freeze"] = freeze
        elif step.name == "base":
            values["base_digest"] = _base_digest(stdout)
    p.definition.write_text(fill(bp.files["apptainer.def"].decode(), values))
    sif_built = any(s.name == "sif" for s in bp.steps) or bool(record.get("sif"))
    if any(s.name == "sif" for s in bp.steps):
        p.archive.unlink(missing_ok=True)  # the SIF holds the image now; the archive was only its way there
    if any(s.name in ("sif", "sign") for s in bp.steps):  # a new SIF carries no signature until it is signed
        record["signed_with"] = bp.sign_key if any(s.name == "sign" for s in bp.steps) else None
    record.update(bp.provenance)
    record.update({"tag": bp.tag, "builder": bp.builder, "base_digest": values.get("base_digest"),
                   "labels": dict((k, fill(v, values)) for k, v in labels(bp.provenance)),
                   "archive": str(p.archive) if p.archive.is_file() else None, "sif": str(p.sif) if sif_built else None,
                   "build_dir": str(p.build_dir), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "host": socket.gethostname(), "durations": durations})
    text = json.dumps(record, indent=2) + "\n"
    atomic_write(p.build_dir / "image.json", text)
    atomic_write(p.record, text)
    print(f"built {p.sif if sif_built else bp.tag} (spec {bp.spec_hash}) in {time.monotonic() - t0:.1f} s; "
          f"provenance: {p.record}", file=out)
    for note in bp.notes:
        print(f"note: {note.replace('will be ready', 'is ready')}", file=out)
    return 0


def image_problem(cfg: Config, image: str | Path) -> str | None:
    """Why ``image`` is not the image of this config's spec (missing, or built from another spec), or None."""
    h = render.spec_hash(cfg, image_code_files(cfg))
    c = cfg.data["container"]
    kind = render.image_kind(cfg)
    if kind == "tag":
        record = read_json(paths(cfg, h).record, None)
        if not isinstance(record, dict) or record.get("spec_hash") != h:
            return f"image {image}: no complete build of spec {h} recorded in {paths(cfg, h).record}"
        if not _builder_has("podman", str(image)):
            return f"image {image} (spec {h}) is not in this machine's podman storage"
        return None
    sif = Path(image)
    record = read_json(sif.with_suffix(".json"), None)
    if sif.is_file():
        if isinstance(record, dict) and record.get("spec_hash") == h:
            return None
        if isinstance(record, dict):
            return f"image {sif} was built from spec {record.get('spec_hash')}, but this config gives spec {h}"
        if sif.name == f"{cfg.name}-{h}.sif":
            return None  # the name carries the spec hash (a SIF built on another machine and copied here)
        return f"image {sif} has no provenance record {sif.with_suffix('.json').name}, so its spec is unknown"
    if kind == "sqsh":
        return (f"image {sif} not found; on a node with enroot run: "
                f"{shlex.join(enroot_argv(c['builder'], image_tag(cfg, h), paths(cfg, h)))}")
    if sif.with_suffix(".tar").is_file():
        return (f"image {sif} not found, only its archive (no apptainer where it was built); run: "
                f"apptainer build {sif} {paths(cfg, h).definition}")
    others = sorted(sif.parent.glob(f"{cfg.name}-*.sif")) if sif.parent.is_dir() else []
    if others:
        return f"image {sif} not found; {others[-1].name} was built from a different spec (this config gives {h})"
    return f"image {sif} not found"


def main(args: Any) -> int:
    if args.from_run:
        bp = plan_from_run(args.from_run, force=args.force)
    elif args.config:
        bp = plan(args.config, args.overrides, force=args.force)
    else:
        raise BuildError("runner build: found neither CONF nor --from-run; expected one. hint: runner build CONF")
    if args.dry_run:
        print(bp)
        return 0
    return execute(bp)
