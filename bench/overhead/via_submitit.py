"""The submitit side of bench/train_overhead: plain.py's training, submitted the way a submitit user does.

submitit writes its own sbatch script (one srun task per rank), pickles ``plain.main`` with its arguments and
unpickles it in every task; Lightning's SLURMEnvironment reads the ranks from srun's variables. This process
submits and exits; the job inherits its environment (PYTHONPATH, BENCH_TIMES, GLOO_SOCKET_IFNAME), as sbatch
does by default.
Usage: python bench/overhead/via_submitit.py MODEL DIM DEVICES NODES MAX_STEPS EVERY OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import submitit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plain  # noqa: E402


def main() -> None:
    argv = sys.argv[1:8]
    devices, nodes, out = int(argv[2]), int(argv[3]), Path(argv[6])
    executor = submitit.SlurmExecutor(folder=out / "submitit", python=sys.executable)
    executor.update_parameters(nodes=nodes, ntasks_per_node=devices, cpus_per_task=1, time=15,
                               job_name="submitit-bench")
    job = executor.submit(plain.main, argv)
    print(job.job_id)


if __name__ == "__main__":
    main()
