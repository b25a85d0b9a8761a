"""Two gloo ranks on this machine, each calling one function: for decisions every rank must make alike."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any


def _rank(rank: int, port: int, target: Callable[[int, str], Any], case: str, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out.put((rank, target(rank, case)))
    except Exception as e:  # noqa: BLE001 - to the test, which would otherwise wait for this rank
        out.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def on_two_ranks(target: Callable[[int, str], Any], case: str) -> dict[int, Any]:
    """``{rank: target(rank, case)}`` from two processes in one gloo process group (a raised error: its repr).

    ``target`` is a module-level function (the processes are spawned, and import it by name)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, target, case, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    return got
