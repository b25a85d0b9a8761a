"""``runner preflight CONF``: the job's preflight checks on their own, as a short job, with the report printed.

Runs on the login node. It submits the config as a run that stops after the checks (Slurm, or local
processes for a local config), waits for the report the job writes (``preflight.json``) and prints its
table. The checks themselves run inside the job (``runner.job.preflight``); only the report format
(``runner.checks``) is shared, so nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

from runner import spec
from runner.checks import FAIL, table
from runner.errors import PreflightError
from runner.host import scheduler, submit
from runner.rundir import EXIT_PREFLIGHT, read_json


def cli(path: Path, overrides: list[str], wait_s: float = 600) -> int:
    """Run the checks as a short job (Slurm) or local processes and print the table; exit 77 when they fail."""
    name = spec.load(path, overrides).name
    extra = [f"name={name}-preflight", "preflight.only=true", "preflight.enabled=true", "alerts.enabled=false",
             "slurm.requeue=false", "resume.enabled=false", "resume.successor=false"]
    p = submit.plan(path, [*overrides, *extra])
    rd = p.run
    if scheduler.of(p.scheduler).detached:
        submit.execute(p)
        print(f"preflight job {rd.job_id()}: waiting for {rd.preflight}", flush=True)
    else:
        with contextlib.redirect_stdout(io.StringIO()):  # the table below says it all
            submit.execute(p)
    deadline = time.monotonic() + wait_s
    while not rd.preflight.exists():
        if rd.exit_status.exists() and not rd.preflight.exists():
            time.sleep(1.0)  # the report is written before the job exits; give a shared filesystem a moment
            if not rd.preflight.exists():
                status = rd.exit_status_record()
                code = status["exit_code"] if status else None
                raise PreflightError(f"preflight job ended (exit {code}) without a report in {rd.root}; expected "
                                     f"preflight.json. hint: runner logs {rd.root}")
        if time.monotonic() > deadline:
            raise PreflightError(f"no preflight report in {rd.root} after {wait_s:g} s; expected preflight.json. "
                                 "hint: is the job still pending? (squeue)")
        time.sleep(0.2)
    report = read_json(rd.preflight)
    print(table(report), end="")
    print(f"report: {rd.preflight}")
    return EXIT_PREFLIGHT if report["status"] == FAIL else 0
