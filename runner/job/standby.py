"""resume.in_job's warm standby: a task of the step the batch script starts beside the training one, which imports
torch and Lightning while the attempt trains, then waits to become a rank of the next attempt.

An in-job restart's new step would spend most of its start importing (torch's CUDA build and Lightning, about 6 s a
rank on this project's machines, ``torch._dynamo`` alone 2-3 s); the standby's tasks did that beforehand. The
import runs in a thread at the lowest priority (nice 19, that thread only): it takes no core from the training
beside it, and the main thread stays at the priority the rank trains with. Each task says where it waits
(``runner.rundir.Standby``); the begin hook hands the step over when every slot of the attempt's nodes has a task
waiting (``runner.policy.standby_takes``), else the attempt starts cold and the standby stands down. A task on a node
the attempt does not train on exits 0.

Standard library only until the handoff: the tasks start as cheaply as the launcher does.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from runner import world
from runner.rundir import Standby

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting task looks for the handoff: one stat of a small folder's file


def _warm() -> None:
    """Import what every rank imports first, at nice 19 (this thread only: Linux's nice is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for names in (("torch",), ("lightning.pytorch", "pytorch_lightning")):  # the first of each that imports
        for name in names:
            try:
                __import__(name)
                break
            except Exception:  # noqa: BLE001 -- not here, or broken: the rank imports it (or says why) itself
                continue


def wait(folder: Path) -> bool:
    """Import in the background, say this task waits, and wait for the begin hook's handoff; True: this process is now
    a rank of the attempt (its Slurm variables and the attempt's set in ``os.environ``), False: exit 0."""
    threading.Thread(target=_warm, name="runner-standby-import", daemon=True).start()
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    local = int(os.environ.get("SLURM_LOCALID", "0"))
    standby = Standby(folder)
    standby.waiting(node, local)
    while (handoff := standby.handoff_record()) is None:
        time.sleep(POLL_S)
    place = world.standby_env(handoff["nodes"], handoff["per_node"], node, local)
    if place is None:
        return False
    os.environ.update(handoff["env"])
    os.environ.update(place)
    return True
