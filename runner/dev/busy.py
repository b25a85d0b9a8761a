"""A busy partition on the dev cluster: other users' jobs take each node the moment a job gives it back.

STAND-IN for a shared cluster's queue. On a real partition, a job that ends and is requeued or resubmitted goes
back to the queue, and the nodes it released are taken by whoever waited: it starts again minutes or hours later.
The dev cluster's queue is empty, so such a job starts again at once, and recovery that gives the allocation back
looks free. ``Filler`` puts the wait back: it keeps one pending job per node, pinned to it (``--nodelist``, whole
node), at the top priority an administrator can give; whenever a node is released, that job starts there and
holds it ``hold_s`` seconds. It does not reproduce fair-share, job sizes, backfill windows or a queue that grows:
every release costs one ``hold_s``, no more.

A filler that has run is armed again only by ``arm()`` (a benchmark calls it each time the run trains again), so
the run's next release costs ``hold_s`` again and a node is never held twice for one release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner import proc
from runner.dev.devcluster import Cluster

TOP_PRIORITY = 4294967290  # above any priority/basic priority (0xFFFF0000 less the job number); root only
NAME = "busy-filler"


@dataclass
class Filler:
    cluster: Cluster
    hold_s: float = 120.0
    jobs: dict[str, str] = field(default_factory=dict)  # node -> its filler job (pending, running or ended)

    def _squeue(self) -> dict[str, str]:
        """Live filler jobs: job id -> state (PENDING, RUNNING, ...)."""
        out = proc.run(["squeue", "-h", "--name", NAME, "-o", "%i %T"], env=self.cluster.client_env(), timeout=30,
                       check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def arm(self) -> None:
        """One pending filler for each node whose filler has ended (or that never had one)."""
        live = self._squeue()
        for node in self.cluster.nodes:
            if self.jobs.get(node) in live:
                continue
            out = proc.run(["sbatch", "--parsable", f"--job-name={NAME}", f"--nodelist={node}", "--nodes=1",
                            "--exclusive", f"--priority={TOP_PRIORITY}", "--time=60", "--output=/dev/null",
                            f"--wrap=exec sleep {self.hold_s:g}"], env=self.cluster.client_env(), timeout=30)
            self.jobs[node] = out.stdout.strip().split(";")[0]

    def holding(self) -> list[str]:
        """The nodes a filler holds now."""
        live = self._squeue()
        return sorted(node for node, job in self.jobs.items() if live.get(job) == "RUNNING")

    def stop(self) -> None:
        """Cancel every filler, pending or running."""
        if self.jobs:
            proc.run(["scancel", *self.jobs.values()], env=self.cluster.client_env(), timeout=30, check=False)
        self.jobs.clear()
