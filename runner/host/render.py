"""Render the Dockerfile, the Apptainer definition and the sbatch script from one validated config.

It runs on the login node (``runner submit``, ``build``, ``resume``). Templates stay dumb: Python prepares
every value, templates only ``if`` and ``for``. Every value that lands in a shell line passes through the one
quoting filter ``q``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jinja2

from runner import __version__, redaction, world
from runner.errors import BuildError, ConfigError
from runner.rundir import ATTEMPT_ENV, STANDBY_ENV, RunDir
from runner.spec import Config
from runner.spec.typed import Container

LIGHTNING_PIN = "lightning==2.6.*"
NCCL_TESTS_REF = "v2.17.1"  # a release tag, so the image is reproducible


def templates_dir() -> Path:
    """The templates live in the repo's top-level templates/; a wheel carries them inside the package."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "sbatch.sh.j2").is_file():
            return candidate
    raise FileNotFoundError(f"runner templates not found next to {package}")


def q(value: Any) -> str:
    """The one shell-quoting filter: any value becomes one literal shell word."""
    return shlex.quote(str(value))


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # The report pages (*.html.j2) escape every value: run directories hold text from logs. Shell and
        # Dockerfile templates do not (their values go through `q`).
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default_for_string=False),
    )
    env.filters["q"] = q
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(version=__version__, **context)


def base_image(cfg: Config) -> str:
    c = cfg.data["container"]
    return c["base_image"] or f"nvcr.io/nvidia/pytorch:{c['ngc_tag']}-py3"


WHEELHOUSE_IN_BUILD = "/tmp/runner-wheelhouse"  # where the build mounts container.wheelhouse


def wheelhouse(cfg: Config) -> dict[str, int] | None:
    """``container.wheelhouse``'s wheels (name -> size), or None when the build may use the package index.

    Names and sizes, not contents, enter the spec hash: a wheel's name carries its version, and hashing a GB
    of wheels on every ``runner submit`` would cost seconds.
    """
    d = cfg.data["container"]["wheelhouse"]
    if d is None:
        return None
    path = Path(d).resolve()
    wheels = {f.name: f.stat().st_size for f in sorted(path.glob("*.whl"))} if path.is_dir() else {}
    if not wheels:
        raise BuildError(f"container.wheelhouse: found no wheels in {path}; expected a directory of wheels made "
                         f"on this machine. hint: containers/wheelhouse.sh {d}")
    return wheels


def image_spec(cfg: Config) -> dict[str, Any]:
    """Everything that determines the image, and nothing else (so unrelated edits do not rebuild)."""
    c = cfg.data["container"]
    wheels = wheelhouse(cfg)
    offline = {"wheelhouse": hashlib.sha256(json.dumps(wheels, sort_keys=True).encode()).hexdigest()[:12]} \
        if wheels else {}
    return {**offline, "base_image": base_image(cfg), "apt": c["apt"], "pip": c["pip"], "nccl_tests": c["nccl_tests"],
            "perftest": c["perftest"], "install_lightning": c["install_lightning"], "lightning": LIGHTNING_PIN,
            "nccl_tests_ref": NCCL_TESTS_REF,
            "python": c["python"], "workdir": c["workdir"], "code": c["code"],
            # the SIF's encoding, not its files: named only when not the default, so a default spec keeps its hash
            **({"sif_compression": c["sif_compression"]} if c["sif_compression"] != "gzip" else {})}


def spec_labels(cfg: Config, spec_hash: str) -> list[tuple[str, str]]:
    return [("org.opencontainers.image.title", f"runner-{cfg.name}"),
            ("org.opencontainers.image.version", spec_hash),
            ("runner.version", __version__), ("runner.spec_hash", spec_hash), ("runner.config", cfg.name)]


def dockerfile(cfg: Config, spec_hash: str) -> str:
    spec = image_spec(cfg)
    spec.setdefault("wheelhouse", None)
    # Offline builds mount the wheelhouse (copied into the build context) for each pip step, and pip reads
    # only it; the wheelhouse digest in the mount path makes a changed wheelhouse invalidate the layer cache.
    pip_install = f"{q(spec['python'])} -m pip install"
    run_pip = "RUN"
    if spec["wheelhouse"]:
        target = f"{WHEELHOUSE_IN_BUILD}-{spec['wheelhouse']}"
        pip_install += f" --no-index --find-links {target}"
        run_pip = f"RUN --mount=type=bind,source=wheelhouse,target={target}"
    return render("Dockerfile.j2", config_name=cfg.name, labels=spec_labels(cfg, spec_hash), pip_install=pip_install,
                  run_pip=run_pip, **spec)


def apptainer_def(cfg: Config, spec_hash: str, bootstrap: str, source: str,
                  extra_labels: list[tuple[str, str]] | None = None) -> str:
    """``extra_labels``: the build's provenance (``runner build`` adds them; values are single lines)."""
    c = cfg.data["container"]
    labels = spec_labels(cfg, spec_hash)
    labels += [(k, v) for k, v in extra_labels or [] if k not in dict(labels)]
    return render("apptainer.def.j2", config_name=cfg.name, spec_hash=spec_hash, bootstrap=bootstrap,
                  source=source, labels=labels, workdir=c["workdir"], python=c["python"])


def spec_hash(cfg: Config, code_files: dict[str, bytes]) -> str:
    """Content hash of the image: the spec, the templates and the files copied into the image."""
    h = hashlib.sha256(json.dumps(image_spec(cfg), sort_keys=True).encode())
    for name in ("Dockerfile.j2", "apptainer.def.j2"):
        h.update((templates_dir() / name).read_bytes())
    for name in sorted(code_files):
        h.update(name.encode() + b"\0" + hashlib.sha256(code_files[name]).digest())
    return h.hexdigest()[:12]


# How each container runtime starts a rank: the part of the srun line between ``srun ...`` and ``-m runner...``.
#
# One small function per runtime; the rest of the batch script is the same for all of them. Every value goes
# through the one quoting filter ``q``; ``$NAME`` references are left for the batch shell to expand.
#
# - ``apptainer`` / ``singularity``: ``exec --nv --bind SRC:DST IMAGE.sif python``; the launcher's variables are
#   passed with ``--env`` because sites that set ``--cleanenv`` would drop them.
# - ``podman``: ``podman run --rm`` with the host's network, IPC, UTS and PID namespaces (ranks see the node's
#   interfaces and hostname, and their pids are the node's), the binds at the same path inside and outside,
#   and the environment passed explicitly (``SLURM_*`` and the named variables; podman passes nothing by default).
# - ``pyxis``: srun's own ``--container-image`` / ``--container-mounts`` / ``--container-workdir`` flags
#   (NVIDIA enroot + pyxis); pyxis passes the task's environment into the container itself.
# - ``none``: the host's Python.
# Each: (container section, image, bind paths, variable names, run directory) -> shell words
Prefix = Callable[[Container, str, list[str], list[str], str], str]


def _apptainer(c: Container, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    # --pwd as podman's --workdir and pyxis's --container-workdir: Apptainer would otherwise start in the caller's
    # directory (mounted by default), which for a helper job the program starts is wherever that job began.
    parts = [c["runtime"], "exec", "--nv"]
    if binds:
        parts += ["--bind", q(",".join(f"{b}:{b}" for b in binds))]
    for name in env_names:
        parts += ["--env", f'"{name}=${name}"']
    return " ".join([*parts, "--pwd", q(workdir), q(image), q(c["python"])])


def _podman(c: Container, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    # --cgroupns=private: runc mounts the container's own cgroup view instead of bind-mounting the caller's
    # cgroup paths, which fail where a node's cgroup tree is itself a subtree (the dev cluster, nested setups).
    parts = ["podman", "run", "--rm", "--network=host", "--ipc=host", "--uts=host", "--pid=host", "--cgroupns=private",
             "--env", q("SLURM_*"), "--env", "SLURMD_NODENAME"]
    for b in binds:
        parts += ["--volume", q(f"{b}:{b}")]
    for name in env_names:
        parts += ["--env", name]  # NAME alone: podman takes the value from its own environment
    return " ".join([*parts, "--workdir", q(workdir), q(image), q(c["python"])])


def _pyxis(c: Container, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    mounts = ",".join(f"{b}:{b}" for b in binds)
    return " ".join([q(f"--container-image={image}"), q(f"--container-mounts={mounts}"),
                     q(f"--container-workdir={workdir}"), q(c["python"])])


def _none(c: Container, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    return q(sys.executable)


# Per runtime: how a rank starts in it (the srun line's prefix), and what image it runs, which is what `runner build`
# makes for it (runner.host.build): a SIF, the builder's tag, an enroot squashfs, or none.
ImageKind = Literal["sif", "tag", "sqsh", "none"]
RUNTIMES: dict[str, Prefix] = {"apptainer": _apptainer, "singularity": _apptainer, "podman": _podman,
                               "pyxis": _pyxis, "none": _none}
IMAGES: dict[str, ImageKind] = {"apptainer": "sif", "singularity": "sif", "podman": "tag", "pyxis": "sqsh",
                                "none": "none"}
SIF_RUNTIMES = tuple(r for r, kind in IMAGES.items() if kind == "sif")


def image_kind(cfg: Config) -> ImageKind:
    """What image this config's runtime runs."""
    return IMAGES[cfg.data["container"]["runtime"]]


def exec_prefix(cfg: Config, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    """The part of the srun line that differs between runtimes (the process starts in ``workdir``); everything else
    in the script is shared."""
    c = cfg.data["container"]
    return RUNTIMES[c["runtime"]](c, image, binds, env_names, workdir)


# Variables the launcher needs inside the container. Apptainer passes the host environment through by
# default, but sites that set --cleanenv (or APPTAINER_CLEANENV) drop them, so they are passed explicitly.
CONTAINER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RUNNER_PREFLIGHT_PORT", "OMP_NUM_THREADS", "RUNNER_RUN_DIR",
                 ATTEMPT_ENV)
IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # passed only when network.ifname sets them


def secret_env(env: dict[str, object]) -> dict[str, str]:
    """The ``env:`` values that hold a secret this process knows (the webhook URL, ``runner.redaction``): they never
    land in the batch script (mode 0755) or config.yaml, but in ``RUN/secret.env`` (0600), which the script sources."""
    return {k: str(v) for k, v in env.items() if redaction.redact(str(v)) != str(v)}


def secret_env_file(env: dict[str, object]) -> str:
    return "".join(f"export {k}={q(v)}\n" for k, v in sorted(secret_env(env).items()))


def _binds(cfg: Config, run_dir: Path, program_dir: str | None) -> list[str]:
    """What a rank's container binds: the run root, ``container.binds``, and a program's own directory."""
    return sorted({str(run_dir.parent.resolve()), *cfg.data["container"]["binds"],
                   *([program_dir] if program_dir and cfg.data["command"] else [])})


def job_python(cfg: Config, image: str, binds: list[str], env_names: list[str], workdir: str) -> str:
    """The shell words a helper job (a Dask worker job) starts Python with: in the run's image, with these binds and
    variables, in ``workdir``. pyxis has no command of its own (its flags go on srun): a one-task srun step."""
    prefix = exec_prefix(cfg, image, binds, ["OMP_NUM_THREADS", "RUNNER_RUN_DIR", *env_names], workdir)
    return f"srun --ntasks=1 {prefix}" if image_kind(cfg) == "sqsh" else prefix


def program_python(cfg: Config, run_dir: Path, image: str, program_dir: str) -> str:
    """``${container_python}`` in a program's config: Python in the run's image with its ranks' binds and environment,
    in the program's directory, for jobs the program submits itself (ESPnet3's dask-jobqueue workers:
    ``parallel.options.python``)."""
    return job_python(cfg, image, _binds(cfg, run_dir, program_dir), list(cfg.data["env"]), program_dir)


EXPEDITE_SINCE = (25, 11)  # Slurm's --requeue=expedite: a requeued job restarts at top priority, on the same nodes


def requeue_flag(requeue: bool, version: tuple[int, int] | None) -> str:
    """``--requeue=expedite`` where the site's Slurm (``version``: sbatch's, None when unknown) has it, else
    ``--requeue`` (nothing new on older Slurm); ``--no-requeue`` with slurm.requeue off."""
    if not requeue:
        return "--no-requeue"
    return "--requeue=expedite" if version is not None and version >= EXPEDITE_SINCE else "--requeue"


def directives(cfg: Config, slurm_version: tuple[int, int] | None = None) -> list[str]:
    """The batch script's ``#SBATCH`` options but its output file: what the job asks Slurm for. A sweep's job array
    (``array``) carries them once for all its tasks. ``slurm_version``: the site's (``requeue_flag``).

    With slurm.spare_nodes the job asks for num_nodes + spare_nodes nodes and survives the loss of one
    (``--no-kill``): each training step runs on num_nodes of them (the batch script's srun ``--nodelist``)."""
    d, s = cfg.data, cfg.data["slurm"]
    flags = [f"--{key}={s[key]}" for key in ("partition", "account", "qos", "constraint", "mem") if s[key] is not None]
    flags += list(s["extra_flags"])
    gpus = s["gpus_per_node"]
    if gpus is None:
        gpus = d["num_device"] if d["trainer"]["accelerator"] in ("gpu", "cuda") else 0
    spares = s["spare_nodes"]
    return [f"--job-name={cfg.name}", f"--nodes={d['num_nodes'] + spares}", f"--ntasks-per-node={d['num_device']}",
            *([f"--gres=gpu:{gpus}"] if gpus else []), f"--cpus-per-task={s['cpus_per_task']}", f"--time={s['time']}",
            *flags, *(["--no-kill"] if spares else []), requeue_flag(s["requeue"], slurm_version),
            f"--signal=B:{s['signal']}@{s['signal_lead_s']}", "--open-mode=append"]


def step_flags(cfg: Config) -> list[str]:
    """The training step's own srun options (beyond --kill-on-bad-exit and, with spares, ``--nodelist``): with
    spares, exactly num_nodes nodes and the world's tasks; with in-job restarts ``--overlap``: the step of a lost
    node stays "completing" until Slurm hears from that node, and holds its CPUs on the other nodes till then
    (measured on the dev cluster: "step creation temporarily disabled ... Requested nodes are busy")."""
    d = cfg.data
    spares = [f"--nodes={d['num_nodes']}", f"--ntasks={d['num_nodes'] * d['num_device']}"] \
        if d["slurm"]["spare_nodes"] else []
    return [*spares, *(["--overlap"] if d["resume"]["in_job"] else [])]


def sbatch(cfg: Config, run_dir: Path, image: str, program_dir: str | None = None,
           slurm_version: tuple[int, int] | None = None) -> str:
    """The batch script. ``program_dir``: where a program (``command:``) runs, bound into the container;
    ``slurm_version``: the site's (``directives``).

    With resume.in_job the script trains in a loop: after each step the exit hook says whether to train again in
    this job (``world.AGAIN``); with slurm.spare_nodes each step runs on num_nodes of the job's nodes, the ones the
    hooks chose (``world.STEP_NODES_ENV``)."""
    d = cfg.data
    binds = _binds(cfg, run_dir, program_dir)
    everything = sorted((k, str(v)) for k, v in d["env"].items())
    env = [(k, v) for k, v in everything if k not in secret_env(d["env"])]  # the rest: RUN/secret.env (0600)
    ifname = cfg.data["network"]["ifname"]
    standby = d["resume"]["in_job"] and d["resume"]["warm_standby"]
    env_names = [*CONTAINER_ENV, *((STANDBY_ENV,) if standby else ()), *(IFNAME_ENV if ifname else ()),
                 *(k for k, _ in everything)]
    return render("sbatch.sh.j2", config_name=cfg.name, config_hash=cfg.hash(),
                  directives=directives(cfg, slurm_version),
                  in_job=d["resume"]["in_job"], step_size=d["num_nodes"], again=world.AGAIN,
                  step_nodes=world.STEP_NODES_ENV,
                  step_flags=step_flags(cfg), spares=d["slurm"]["spare_nodes"],
                  standby=standby, per_node=d["num_device"], first_beat=str(RunDir(run_dir).heartbeat(0)),
                  world_size=d["num_nodes"] * d["num_device"], signal=d["slurm"]["signal"], run_dir=str(run_dir),
                  env=env, host_python=sys.executable, ifname=ifname,
                  verify_key=verify_key(cfg), exec_prefix=exec_prefix(cfg, image, binds, env_names, str(run_dir)),
                  unset=redaction.webhook_names(cfg.data))


def array(cfgs: list[Config], sweep_id: str, sweep_dir: Path, run_dirs: list[Path], limit: int,
          slurm_version: tuple[int, int] | None = None) -> str:
    """A sweep's job array on Slurm: task i runs ``run_dirs[i]``'s own batch script (``sbatch``), so each task is an
    ordinary run with its own directory. Its options are the runs' (``directives``), which must be one set: a point
    that asks Slurm for something else (more nodes, another partition) is refused.

    Raises:
        ConfigError: the points differ in their ``#SBATCH`` options (the job name aside: the array takes the first's).
    """
    first = directives(cfgs[0], slurm_version)
    for i, cfg in enumerate(cfgs[1:], start=1):
        mine = directives(cfg, slurm_version)
        if mine[1:] != first[1:]:
            theirs = sorted(set(mine[1:]) - set(first[1:]))
            ours = sorted(set(first[1:]) - set(mine[1:]))
            raise ConfigError([f"sweep {sweep_id}: point {i} asks Slurm for {' '.join(theirs)}, point 0 for "
                               f"{' '.join(ours)}; expected one set of #SBATCH options for the sweep's job array. "
                               "hint: sweep such values (num_nodes, num_device, slurm.*) in sweeps of their own"])
    return render("sbatch-array.sh.j2", config_name=cfgs[0].name, sweep_id=sweep_id, directives=first,
                  last=len(run_dirs) - 1, limit=limit, sweep_dir=str(sweep_dir), run_dirs=[str(r) for r in run_dirs])


def verify_key(cfg: Config) -> str | None:
    """``container.verify_key`` as an absolute path (the job's working directory is not the submitter's), for an
    Apptainer runtime only."""
    c = cfg.data["container"]
    return str(Path(c["verify_key"]).resolve()) if c["verify_key"] and c["runtime"] in SIF_RUNTIMES else None
