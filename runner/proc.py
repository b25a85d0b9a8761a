"""The one door to subprocesses: argv lists (never a shell), a timeout always, errors that carry stderr.

Both sides use it (the login node's commands, the ranks' interface detection). Every call site in runner goes
through ``run``; the argv is logged at debug level (``runner -v``), so a user can see every command runner ran.
Only long-lived children with their own lifetime (the local ranks, the dev cluster's daemons, a streamed build
step) use ``subprocess.Popen`` directly.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping

from runner.errors import RunnerError, SubmitError

log = logging.getLogger(__name__)
NOT_FOUND = 127  # the shell's codes, returned with check=False
TIMED_OUT = 124


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment without the caller's job variables.

    sbatch run inside an allocation or a scrontab job would otherwise pass SLURM_* of that job into the new one.
    SLURM_CONF names the cluster and stays.
    """
    env = os.environ if base is None else base
    return {k: v for k, v in env.items() if k == "SLURM_CONF" or not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}


def run(argv: list[str], *, timeout: float = 60, check: bool = True, input: str | None = None,
        env: Mapping[str, str] | None = None, clean: bool = False, cwd: str | None = None,
        error: type[RunnerError] = SubmitError) -> subprocess.CompletedProcess[str]:
    """Run a command to completion and return it (``.stdout``, ``.stderr``, ``.returncode``).

    With ``check`` (the default) a missing command, a timeout or a non-zero exit raises ``error`` with one
    line: the command and its last stderr line. Without it nothing raises: a missing command returns 127 and a
    timeout 124, as a shell would, so a caller that only tries (``scontrol requeue`` in a hook) stays short.
    ``clean`` drops the caller's SLURM_* job variables (see ``clean_env``). Without ``input`` the command reads
    /dev/null: a command that asks a question must fail, not wait for a terminal that cron does not have.
    """
    log.debug("+ %s", shlex.join(argv))
    full_env = clean_env(env) if clean else (dict(env) if env is not None else None)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input, env=full_env,
                             cwd=cwd, errors="replace", stdin=subprocess.DEVNULL if input is None else None)
    except FileNotFoundError:
        if check:
            raise error(f"{argv[0]}: command not found. hint: install it or check PATH") from None
        return subprocess.CompletedProcess(argv, NOT_FOUND, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        if check:
            raise error(f"{argv[0]}: no answer within {timeout:g} s. hint: is the service up?") from None
        return subprocess.CompletedProcess(argv, TIMED_OUT, "", f"{argv[0]}: no answer within {timeout:g} s")
    if check and out.returncode != 0:
        raise error(f"{argv[0]} failed (exit {out.returncode}): {last_line(out)}")
    return out


def last_line(out: subprocess.CompletedProcess[str]) -> str:
    """The command's own last word on what went wrong (stderr, else stdout), on one line."""
    lines = [line.strip() for line in (out.stderr or out.stdout or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {out.returncode}"
