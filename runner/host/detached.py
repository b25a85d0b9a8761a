"""The process a background driver runs in (``runner.host.background`` starts it): what ``runner submit`` and
``runner resume`` run for a local run, or a sweep's driver, with a RunnerError handed to the caller that started it.

    python -m runner.host.detached start RUN_DIR WORLD_SIZE
    python -m runner.host.detached resume RUN_DIR [--force] [key=value ...]
    python -m runner.host.detached sweep SWEEP_DIR [PARALLEL]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from runner import log
from runner.errors import RunnerError
from runner.host.background import ERROR_FD_ENV
from runner.rundir import RunDir


def _say(e: RunnerError) -> None:
    """Tell the caller (through ``ERROR_FD_ENV``) which error the driver ended with; a caller gone is no matter."""
    fd = os.environ.get(ERROR_FD_ENV, "")
    if not fd.isdigit():
        return
    with contextlib.suppress(OSError):
        os.write(int(fd), json.dumps({"kind": type(e).__name__, "message": str(e), "exit_code": e.exit_code}).encode())


def main(argv: list[str]) -> int:
    log.setup(0)
    action, path, *rest = argv
    try:
        if action == "start":
            from runner.host import scheduler

            return scheduler.LOCAL.start(RunDir(Path(path)), int(rest[0]))
        if action == "sweep":
            from runner.host import sweep as sweeps

            return sweeps.drive(sweeps.SweepDir(Path(path)), int(rest[0]) if rest else None)
        from runner.host import submit

        return submit.resume_any(RunDir(Path(path)), [a for a in rest if a != "--force"], force="--force" in rest)
    except RunnerError as e:
        _say(e)
        for line in str(e).splitlines():
            print(f"runner: error: {line}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
