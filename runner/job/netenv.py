"""The NCCL / gloo / torch.distributed environment of a run, set by the launcher before any process group.

Why: the costliest multi-node failures are silent (NCCL on the wrong interface, a rendezvous hang that
surfaces only after Lightning's 30-minute default). Every rank sets the same variables, from the config's
``network:`` block or detected from the route to MASTER_ADDR, and rank 0 records them with where each value
came from in ``RUN_DIR/env.json``. A value the user set (the config's ``env:`` block, or one already in the
environment, e.g. from a site module) wins over runner's and is reported, so nothing is overridden silently.

Runs in each rank, first thing in the launcher (``setup``); the interface is detected there once per rank and
the preflight checks that same result. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.job.ifname import IFNAME_VARS, detect_ifname
from runner.rundir import RunDir, atomic_write
from runner.spec.typed import RunConfig

log = logging.getLogger(__name__)

RUNNER = "runner"
DETECTED = "detected from the route to MASTER_ADDR"
CONFIG = "config network:"
USER = "config env:"
INHERITED = "environment"

# Variables a user may set that matter to the interconnect; recorded when present even if runner sets none.
RECORDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_", "MASTER_")


@dataclass(frozen=True)
class Var:
    """One variable: its value in effect, where that came from, and runner's own value when a user's won."""

    value: str
    source: str
    runner_value: str | None = None


@dataclass
class NetEnv:
    """The interconnect environment of one rank, as decided by `plan`."""

    vars: dict[str, Var]
    pg_timeout_s: int
    host: str = ""
    detected: str | None = None  # the interface of the route to MASTER_ADDR on this node, whatever is in effect

    @property
    def ifname(self) -> str | None:
        """The interface spec in effect for gloo (what the preflight checks on every node)."""
        var = self.vars.get("GLOO_SOCKET_IFNAME") or self.vars.get("NCCL_SOCKET_IFNAME")
        return var.value if var else None

    def overridden(self) -> list[str]:
        """Names where a user's value replaced a different value runner would have set."""
        return sorted(k for k, v in self.vars.items() if v.runner_value is not None and v.runner_value != v.value)

    def report(self) -> list[str]:
        """One line per user override, for the rank log (the rest is in env.json)."""
        return [f"env {k}={self.vars[k].value!r} from {self.vars[k].source} wins over runner's "
                f"{self.vars[k].runner_value!r}" for k in self.overridden()]

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "pg_timeout_s": self.pg_timeout_s, "detected": self.detected,
                "vars": {k: asdict(v) for k, v in sorted(self.vars.items())}, "overridden": self.overridden()}


def nccl_debug_file(log_dir: Path) -> str:
    """One NCCL debug file per host and process: NCCL itself expands %h (hostname) and %p (pid)."""
    return str(log_dir / "nccl" / "nccl-%h-%p.log")


def wanted(net: Mapping[str, Any], log_dir: Path, detected: str | None) -> dict[str, tuple[str, str]]:
    """What runner would set, name -> (value, source), before any user value is considered."""
    debug = bool(net.get("debug"))
    out = {
        "NCCL_DEBUG": ("INFO" if debug else "WARN", RUNNER),
        "NCCL_DEBUG_SUBSYS": ("INIT,NET", RUNNER),
        "NCCL_DEBUG_FILE": (nccl_debug_file(log_dir), RUNNER),
        # Abort the communicator and fail the process on a NCCL error or timeout instead of hanging.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", RUNNER),
    }
    ifname, source = (net.get("ifname"), CONFIG) if net.get("ifname") else (detected, DETECTED)
    if ifname:
        out.update({name: (str(ifname), source) for name in IFNAME_VARS})
    if net.get("ib_hca"):
        out["NCCL_IB_HCA"] = (str(net["ib_hca"]), CONFIG)
    if debug:
        out["TORCH_DISTRIBUTED_DEBUG"] = ("DETAIL", RUNNER)
    return out


def plan(cfg: RunConfig, log_dir: Path, environ: Mapping[str, str], detected: str | None) -> NetEnv:
    """Decide every variable; touches nothing (the env is read from `environ`, not changed).

    ``detected`` is the interface of the route to MASTER_ADDR (``ifname.detect_ifname``), used when the config
    names none. Precedence: the config's ``env:`` block, then a value already in the environment (a site
    module, the user's shell, the batch script's export of ``network.ifname``), then runner's value.
    """
    net = cfg.get("network") or {}
    user = {k: str(v) for k, v in (cfg.get("env") or {}).items()}
    result: dict[str, Var] = {}
    for name, (value, source) in wanted(net, log_dir, detected).items():
        if name in user:
            result[name] = Var(user[name], USER, value)
        elif name in environ and environ[name] != value:
            result[name] = Var(environ[name], INHERITED, value)
        else:
            result[name] = Var(value, source)
    for name, value in user.items():
        if name not in result and name.startswith(RECORDED_PREFIXES):
            result[name] = Var(value, USER)
    for name, value in environ.items():
        if name not in result and name.startswith(RECORDED_PREFIXES):
            result[name] = Var(value, INHERITED)
    return NetEnv(result, int(net.get("pg_timeout_s") or 300), socket.gethostname(), detected)


def apply(ne: NetEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Export every variable into this process (children inherit it) and create the NCCL log folder."""
    env = os.environ if environ is None else environ
    for name, var in ne.vars.items():
        env[name] = var.value
    debug_file = ne.vars.get("NCCL_DEBUG_FILE")
    if debug_file:
        Path(debug_file.value).parent.mkdir(parents=True, exist_ok=True)


def record(ne: NetEnv, path: Path) -> None:
    """Write env.json (rank 0): what the job ran with, and which user values won."""
    atomic_write(path, json.dumps(ne.to_json(), indent=2) + "\n")


def setup(cfg: RunConfig, rd: RunDir, rank: int, environ: MutableMapping[str, str] | None = None) -> NetEnv:
    """The launcher's first step in every rank: detect the interface once, decide, export, report, record.

    ``environ`` is read and exported into (this process's environment by default).
    """
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR")
    ne = plan(cfg, rd.logs, env, detect_ifname(master) if master else None)
    apply(ne, env)
    for line in ne.report():
        log.info("%s", line)
    if rank == 0:
        record(ne, rd.env_file)
    return ne
