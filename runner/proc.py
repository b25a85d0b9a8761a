"""The one door to subprocesses: argv lists (never a shell), a timeout, and errors that carry stderr."""

from __future__ import annotations

import os
import subprocess

from runner.errors import SubmitError

VERBOSE = bool(os.environ.get("RUNNER_VERBOSE"))


def run(argv: list[str], timeout: float = 60, env: dict[str, str] | None = None,
        error: type[Exception] = SubmitError) -> str:
    """Run a command and return its stdout; raise ``error`` with its first stderr line on failure."""
    if VERBOSE:
        print("+ " + " ".join(argv))
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise error(f"{argv[0]}: command not found. hint: install it or check PATH") from None
    except subprocess.TimeoutExpired:
        raise error(f"{argv[0]}: no answer within {timeout:g} s. hint: is the service up?") from None
    if out.returncode != 0:
        msg = " ".join((out.stderr or out.stdout).strip().split("\n")[-1:]) or f"exit code {out.returncode}"
        raise error(f"{argv[0]} failed (exit {out.returncode}): {msg}")
    return out.stdout
