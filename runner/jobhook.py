"""Host-side hooks called by the batch script (start, exit); extended by the failure-handling issue."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from runner.rundir import RunDir, atomic_write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.jobhook")
    parser.add_argument("what", choices=("start", "exit"))
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="none")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    job = os.environ.get("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if args.what == "start":
        run.record("start", job_id=job, restarts=restarts, nodes=os.environ.get("SLURM_JOB_NODELIST"))
        return 0
    status = {"exit_code": args.rc, "job_id": job, "restarts": restarts, "signal": args.signal, "time": time.time()}
    atomic_write(run.exit_status, json.dumps(status) + "\n")
    run.record("exit", job_id=job, exit_code=args.rc, signal=args.signal, restarts=restarts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
