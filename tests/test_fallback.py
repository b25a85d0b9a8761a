"""A checkpoint that verified yet failed to load (runner.job.fallback): which failures are the checkpoint's and what
the ranks agree on. Where Lightning reads and applies one (internals.watch_restore): tests/test_internals.py; the
2-rank fall back to the previous checkpoint: tests/test_fsdp_local.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from runner.job import fallback  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def trainer(tmp_path: Path, steps: int) -> Any:
    return L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=str(tmp_path))


def dcp(*failures: BaseException) -> CheckpointException:
    return CheckpointException("load failed", {rank: (e, None) for rank, e in enumerate(failures)})


@pytest.mark.parametrize(("error", "loading", "why"), [
    (RuntimeError("size mismatch for net.0.weight"), True, "RuntimeError: size mismatch for net.0.weight"),
    (dcp(AttributeError("'float' object has no attribute 'size'"), KeyError("x")), True,
     "rank 0: AttributeError: 'float' object has no attribute 'size'"),
    # the machine's failures, not the checkpoint's: a crash as before, the checkpoint kept
    (torch.OutOfMemoryError("CUDA out of memory"), True, None),
    (dcp(ValueError("bad"), torch.OutOfMemoryError("CUDA out of memory")), True, None),
    (torch.distributed.DistNetworkError("connection reset"), True, None),
    (TimeoutError("store"), True, None),
    (RuntimeError("step 5 failed"), False, None),  # after the restore: training's crash
    (fallback.PeerFailed("x"), False, None),  # a peer failed otherwise (the word was not BAD)
])
def test_a_failure_while_loading_is_the_checkpoints_unless_the_machine_failed(
        tmp_path: Path, error: BaseException, loading: bool, why: str | None) -> None:
    watch = fallback.LoadWatch(trainer(tmp_path, 1))
    watch.loading = loading
    assert watch.failed(error) == why
    assert watch.failed(RuntimeError("again")) is None  # said once: a second failure of the fit is a crash


def test_a_rank_that_loaded_stops_with_the_one_that_did_not(tmp_path: Path) -> None:
    """Without a process group the word is this rank's own; PeerFailed carries the agreed BAD."""
    watch = fallback.LoadWatch(trainer(tmp_path, 1))
    watch.loaded()  # LOADED: nothing raised, the restore's later calls ignored
    assert watch.agreed == fallback.LOADED and watch.failed(RuntimeError("after")) is None
    peer = fallback.LoadWatch(trainer(tmp_path, 1))
    peer.agreed = fallback.BAD  # what the reduction gave a rank that loaded while another failed on the checkpoint
    assert peer.failed(fallback.PeerFailed("x")) == "another rank failed to load it"
