"""How each container runtime starts a rank: the part of the srun line between ``srun ...`` and ``-m runner...``.

One small function per runtime; the rest of the batch script is the same for all of them. Every value goes
through the one quoting filter (``render.q``); ``$NAME`` references are left for the batch shell to expand.

- ``apptainer`` / ``singularity``: ``exec --nv --bind SRC:DST IMAGE.sif python``; the launcher's variables are
  passed with ``--env`` because sites that set ``--cleanenv`` would drop them.
- ``podman``: ``podman run --rm`` with the host's network, IPC, UTS and PID namespaces (ranks see the node's
  interfaces and hostname, and their pids are the node's), the binds at the same path inside and outside,
  and the environment passed explicitly (``SLURM_*`` and the named variables; podman passes nothing by default).
- ``pyxis``: srun's own ``--container-image`` / ``--container-mounts`` / ``--container-workdir`` flags
  (NVIDIA enroot + pyxis); pyxis passes the task's environment into the container itself.
- ``none``: the host's Python.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from runner.host.render import q as _q
from runner.spec.typed import Container

# name -> (container section, image, bind paths, variable names, run directory) -> shell words
Prefix = Callable[[Container, str, list[str], list[str], str], str]


def apptainer(c: Container, image: str, binds: list[str], env_names: list[str], run_dir: str) -> str:
    parts = [c["runtime"], "exec", "--nv"]
    if binds:
        parts += ["--bind", _q(",".join(f"{b}:{b}" for b in binds))]
    for name in env_names:
        parts += ["--env", f'"{name}=${name}"']
    return " ".join([*parts, _q(image), _q(c["python"])])


def podman(c: Container, image: str, binds: list[str], env_names: list[str], run_dir: str) -> str:
    parts = ["podman", "run", "--rm", "--network=host", "--ipc=host", "--uts=host", "--pid=host",
             "--env", _q("SLURM_*")]
    for b in binds:
        parts += ["--volume", _q(f"{b}:{b}")]
    for name in env_names:
        parts += ["--env", name]  # NAME alone: podman takes the value from its own environment
    return " ".join([*parts, "--workdir", _q(run_dir), _q(image), _q(c["python"])])


def pyxis(c: Container, image: str, binds: list[str], env_names: list[str], run_dir: str) -> str:
    mounts = ",".join(f"{b}:{b}" for b in binds)
    return " ".join([_q(f"--container-image={image}"), _q(f"--container-mounts={mounts}"),
                     _q(f"--container-workdir={run_dir}"), _q(c["python"])])


def none(c: Container, image: str, binds: list[str], env_names: list[str], run_dir: str) -> str:
    return _q(sys.executable)


PREFIXES: dict[str, Prefix] = {"apptainer": apptainer, "singularity": apptainer, "podman": podman,
                               "pyxis": pyxis, "none": none}
