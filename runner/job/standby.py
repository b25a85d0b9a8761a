"""resume.in_job's warm standby: a task of the step the batch script starts beside the training one, which imports
torch and Lightning while the attempt trains, then waits to become a rank of the next attempt.

An in-job restart's new step would spend most of its start importing (torch's CUDA build and Lightning, about 6 s a
rank on this project's machines, ``torch._dynamo`` alone 2-3 s); the standby's tasks did that beforehand. The
import runs in a thread at the lowest priority (nice 19), and the task's session waits at nice 19 too (Linux shares
the CPU between sessions before it looks at a thread's nice): it takes no core from the training beside it. Once
handed an attempt the session is back at 0, and the main thread trains at the priority a rank has. Each task says
where it waits (``runner.rundir.Standby``); the begin hook hands the step over when every slot of the attempt's
nodes has a task waiting (``runner.policy.standby_takes``), else the attempt starts cold and the standby stands
down. A task on a node the attempt does not train on exits 0.

Standard library only until the handoff: the tasks start as cheaply as the launcher does.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runner import world
from runner.rundir import Standby

POLL_S = 0.05  # how often a waiting task looks for the handoff: one stat of a small folder's file
AUTOGROUP = Path("/proc/self/autogroup")


def _autogroup_nice(nice: int, tries: int = 50) -> bool:
    """Set the nice value of this process's autogroup (Linux's ``sched_autogroup``: the CPU is shared fairly between
    sessions first, and a nice value counts only within its session, so a task of another srun step would take its
    full share whatever its threads' nice). 0..19 needs no privilege; the kernel takes one change every 100 ms from
    all unprivileged processes together (EAGAIN), so this retries. False where there is no autogroup to set."""
    for _ in range(tries):
        try:
            AUTOGROUP.write_text(f"{nice}\n")
            return True
        except BlockingIOError:  # EAGAIN: another process's change in the last 100 ms
            time.sleep(random.uniform(0.02, 0.12))
        except OSError:  # no autogroups (disabled, or a read-only /proc in the container)
            return False
    return False


def _warm(said: Callable[[], None]) -> None:
    """Import what every rank imports first, at nice 19 (this thread only: Linux's nice is per thread); then ``said``
    (the task's word that it is warm: ``runner.rundir.Standby``, for whoever measures or waits on it)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for names in (("torch",), ("lightning.pytorch", "pytorch_lightning")):  # the first of each that imports
        for name in names:
            try:
                __import__(name)
                break
            except Exception:  # noqa: BLE001 -- not here, or broken: the rank imports it (or says why) itself
                continue
    with contextlib.suppress(OSError):
        said()


def wait(folder: Path) -> bool:
    """Import in the background, say this task waits, and wait for the begin hook's handoff; True: this process is now
    a rank of the attempt (its Slurm variables and the attempt's set in ``os.environ``), False: exit 0."""
    _autogroup_nice(19)  # until the handoff: no core taken from the training step beside it
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    local = int(os.environ.get("SLURM_LOCALID", "0"))
    standby = Standby(folder)
    standby.waiting(node, local)
    threading.Thread(target=_warm, args=(lambda: standby.waiting(node, local, warm=True),),
                     name="runner-standby-import", daemon=True).start()
    while (handoff := standby.handoff_record()) is None:
        time.sleep(POLL_S)
    place = world.standby_env(handoff["nodes"], handoff["per_node"], node, local)
    if place is None:
        return False
    os.environ.update(handoff["env"])
    os.environ.update(place)
    # The rank trains at the priority a rank has: the autogroup back to 0 (in the background: the kernel's 100 ms
    # grain would otherwise hold up this node's other ranks one after another).
    threading.Thread(target=_autogroup_nice, args=(0, 100), name="runner-standby-priority", daemon=True).start()
    return True
