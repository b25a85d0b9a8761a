"""Checkpoint verification on disk (no training): what a resume refuses to trust."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from runner import checkpoint

pytestmark = pytest.mark.unit


def make(root: Path, files: dict[str, bytes], step: int = 10) -> Path:
    """A complete checkpoint whose manifest lists `files` with their real sizes and hashes."""
    staging = checkpoint.CheckpointDir(root).staging(step)
    staging.mkdir(parents=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    return checkpoint.publish(root, step, {"step": step, "config_hash": "h"})


def test_a_good_checkpoint_verifies(tmp_path: Path) -> None:
    path = make(tmp_path, {"model.ckpt": b"weights", "rng-rank00000.pt": b"rng"})
    assert checkpoint.verify(path) is None
    assert checkpoint.latest(tmp_path, "h", check=True) == (10, path)


def test_a_manifest_without_the_model_is_refused(tmp_path: Path) -> None:
    path = make(tmp_path, {"rng-rank00000.pt": b"rng"})
    assert checkpoint.verify(path) == "manifest does not list model.ckpt"
    assert checkpoint.latest(tmp_path, "h", check=True) is None


def test_a_symlink_leaving_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """The link points at a file with exactly the listed size and hash: only its being a link can refuse it."""
    outside = tmp_path / "elsewhere.ckpt"
    outside.write_bytes(b"weights")
    path = make(tmp_path / "ckpts", {"model.ckpt": b"weights", "rng-rank00000.pt": b"rng"})
    (path / "model.ckpt").unlink()
    (path / "model.ckpt").symlink_to(outside)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"]["model.ckpt"]["sha256"] == hashlib.sha256(outside.read_bytes()).hexdigest()
    assert "not a plain file" in (checkpoint.verify(path) or "")


def test_a_checkpoint_that_failed_to_load_is_skipped_as_a_damaged_one_and_never_pruned(tmp_path: Path) -> None:
    """``mark_unloadable`` (runner.job.fallback, rank 0): the newest verifies, yet a resume skips it from then on
    for the previous one; prune neither counts nor removes it; a marker that cannot be read still skips it."""
    older = make(tmp_path, {"model.ckpt": b"weights"}, step=10)
    newest = make(tmp_path, {"model.ckpt": b"weights2"}, step=20)
    assert checkpoint.latest(tmp_path, "h", check=True) == (20, newest)
    checkpoint.mark_unloadable(newest, "rank 0: UnpicklingError: invalid load key")
    assert checkpoint.verify(newest) == "it failed to load before (rank 0: UnpicklingError: invalid load key)"
    assert checkpoint.latest(tmp_path, "h", check=True) == (10, older)
    checkpoint.prune(tmp_path, keep=1)
    assert older.is_dir() and newest.is_dir()  # the one kept is the newest that loads; the marked one is left
    checkpoint.CheckpointDir.unloadable(newest).write_text("{torn")
    assert checkpoint.verify(newest) == "it failed to load before"


def test_a_manifest_naming_a_path_outside_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"x")
    path = make(tmp_path / "ckpts", {"model.ckpt": b"weights"})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../../secret"] = {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert "not a plain file" in (checkpoint.verify(path) or "")


def test_one_write_in_flight_and_errors_reach_the_caller(tmp_path: Path) -> None:
    import threading

    import pytest

    writer = checkpoint.Writer()
    order: list[str] = []
    gate = threading.Event()

    def first() -> None:
        gate.wait(5)
        order.append("first")

    writer.submit(first)
    threading.Timer(0.3, gate.set).start()
    writer.submit(lambda: order.append("second"))  # waits for the first to finish
    writer.wait()
    assert order == ["first", "second"]

    def broken() -> None:
        raise OSError("disk full")

    writer.submit(broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # reported once


def test_the_checkpoint_directory_names_every_file(tmp_path: Path) -> None:
    """The layout on disk, which the host side and older runner versions read: one class names it."""
    ckpts = checkpoint.CheckpointDir(tmp_path)
    step, staging = ckpts.step(20), ckpts.staging(20)
    assert (step.name, staging.name) == ("step-0000020", ".staging-step-0000020")
    assert [p.name for p in (ckpts.marker(step), ckpts.model(step), ckpts.manifest(step), ckpts.meta(step),
                             ckpts.rng(step, 3), ckpts.digest(staging, 3))] == \
        ["COMPLETE", "model.ckpt", "manifest.json", "meta.pt", "rng-rank00003.pt", "shard-rank00003.json"]
    for d in (step, staging, ckpts.step(1234567), *(tmp_path / n for n in ("step-12", "step-x", ".staging-step-x"))):
        d.mkdir()
    (staging / "__3_0.distcp").write_bytes(b"shard")
    assert sorted(ckpts.steps()) == [(20, step), (1234567, ckpts.step(1234567))]  # seven digits or more
    assert ckpts.stagings() == [(20, staging)] and ckpts.shards(staging, 3) == [staging / "__3_0.distcp"]


def test_a_mid_epoch_checkpoint_of_a_loader_that_cannot_be_positioned_is_passed_over_and_its_epoch_start_kept(
        tmp_path: Path) -> None:
    """``latest(positioned=True)``, a resume's: the newest checkpoint, taken mid-epoch with a loader runner cannot
    position there (``position: epoch start``), gives way to the newest at an epoch's end, which ``prune`` keeps
    beyond ``keep``; a replayed loader's mid-epoch checkpoint is resumed as it is."""
    def make_at(step: int, mid: bool, position: str) -> Path:
        checkpoint.CheckpointDir(tmp_path).staging(step).mkdir(parents=True)
        (checkpoint.CheckpointDir(tmp_path).staging(step) / "model.ckpt").write_bytes(b"w")
        return checkpoint.publish(tmp_path, step, {"step": step, "config_hash": "h", "mid_epoch": mid,
                                                   "position": position})

    boundary = make_at(16, False, checkpoint.EPOCH_START)
    make_at(18, True, checkpoint.EPOCH_START)
    stop = make_at(21, True, checkpoint.EPOCH_START)
    assert checkpoint.passed_over(stop) and not checkpoint.passed_over(boundary)
    assert checkpoint.latest(tmp_path, "h", check=True) == (21, stop)
    assert checkpoint.latest(tmp_path, "h", check=True, positioned=True) == (16, boundary)
    checkpoint.prune(tmp_path, keep=1)
    assert [step for step, _ in checkpoint.complete(tmp_path)] == [21, 16]
    replayed = make_at(23, True, "replayed")
    assert checkpoint.latest(tmp_path, "h", check=True, positioned=True) == (23, replayed)
