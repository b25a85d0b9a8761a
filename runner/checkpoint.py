"""Checkpoint directories on disk: ``step-XXXXXXX/`` with a manifest and a ``COMPLETE`` marker written last.

The launcher writes them inside the allocation; ``runner status`` and ``runner cron`` read them on the login
node, so this module is filesystem-only (no torch) and quick. A directory without ``COMPLETE`` is a write that
never finished: it is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runner import records
from runner.records import CheckpointManifest
from runner.rundir import atomic_write, read_json

SHARDED = "dcp"  # manifest "format" of a sharded checkpoint: torch distributed checkpoint files, one per rank
log = logging.getLogger(__name__)


class CheckpointDir:
    """A run's checkpoints root and every file name in it, in the manner of submitit's ``JobPaths``: nothing else
    joins a checkpoint's names. A step is written into its staging directory, invisible to readers, published by a
    rename and marked complete last; the class methods name the files of one step directory, staging or published.
    """

    MARKER = "COMPLETE"
    UNLOADABLE = "UNLOADABLE"  # a complete, verified checkpoint that failed to load: why (never tried again)
    MODEL = "model.ckpt"  # the whole Lightning checkpoint (DDP, FSDP1: gathered)
    MANIFEST = "manifest.json"  # step, time, config hash, files and their digests; written last, before MARKER
    DCP_INDEX = ".metadata"  # a sharded checkpoint: torch DCP's index of the shards
    DCP_META = "meta.pt"  # a sharded checkpoint: Lightning's non-tensor state (internals.META, tested equal)
    _STEP = re.compile(r"^step-(\d{7,})$")
    _STAGING = re.compile(r"^\.staging-step-(\d+)$")

    def __init__(self, root: Path) -> None:
        self.root = root

    def step(self, step: int) -> Path:
        return self.root / f"step-{step:07d}"

    def staging(self, step: int) -> Path:
        """Where ranks write before the checkpoint is published by a rename (invisible to readers)."""
        return self.root / f".staging-step-{step:07d}"

    def steps(self) -> list[tuple[int, Path]]:
        """Every published step directory, complete or not, with its step (in no order)."""
        return self._numbered(self._STEP)

    def stagings(self) -> list[tuple[int, Path]]:
        """Every staging directory, with its step (in no order)."""
        return self._numbered(self._STAGING)

    def _numbered(self, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
        found = [(pattern.match(p.name), p) for p in self.root.iterdir()] if self.root.is_dir() else []
        return [(int(m.group(1)), p) for m, p in found if m]

    @classmethod
    def marker(cls, step_dir: Path) -> Path:
        return step_dir / cls.MARKER

    @classmethod
    def unloadable(cls, step_dir: Path) -> Path:
        return step_dir / cls.UNLOADABLE

    @classmethod
    def model(cls, step_dir: Path) -> Path:
        return step_dir / cls.MODEL

    @classmethod
    def manifest(cls, step_dir: Path) -> Path:
        return step_dir / cls.MANIFEST

    @classmethod
    def meta(cls, step_dir: Path) -> Path:
        return step_dir / cls.DCP_META

    @staticmethod
    def rng(step_dir: Path, rank: int) -> Path:
        """One rank's random generators at the step."""
        return step_dir / f"rng-rank{rank:05d}.pt"

    @staticmethod
    def digest(step_dir: Path, rank: int) -> Path:
        """Where a rank leaves the size and sha256 of the shard it wrote, for rank 0's manifest."""
        return step_dir / f"shard-rank{rank:05d}.json"

    @staticmethod
    def shards(step_dir: Path, rank: int) -> list[Path]:
        """The DCP shard files one rank wrote (DCP names them ``__RANK_N.distcp``)."""
        return sorted(step_dir.glob(f"__{rank}_*.distcp"))


def complete(root: Path, config_hash: str | None = None, force: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints, newest first; incomplete ones and ones of another config are skipped loudly."""
    found = []
    for step, path in CheckpointDir(root).steps():
        if not CheckpointDir.marker(path).is_file():
            log.warning("skipping %s: no %s marker (a write that never finished)", path, CheckpointDir.MARKER)
            continue
        manifest = manifest_of(path)
        if config_hash and manifest.get("config_hash") != config_hash and not force:
            log.warning("skipping %s: written by config %s, this run is %s (resume.force=true overrides)", path,
                        manifest.get("config_hash"), config_hash)
            continue
        found.append((step, path))
    return sorted(found, reverse=True)


def verify(path: Path) -> str | None:
    """None if every file matches the manifest's size and sha256, else what is wrong.

    A manifest must list the model, and every file must be a plain file inside the checkpoint directory: a
    symlink (or a name with ``..``) could make a damaged or foreign file look verified.
    """
    failed = read_json(CheckpointDir.unloadable(path), None)
    if failed is not None or CheckpointDir.unloadable(path).exists():
        why = failed.get("why") if isinstance(failed, dict) else None
        return f"it failed to load before ({why})" if isinstance(why, str) and why else "it failed to load before"
    manifest = manifest_of(path)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    if manifest.get("format") == SHARDED:
        shards = manifest.get("shards")
        world = manifest.get("world_size")
        if not isinstance(shards, dict) or not isinstance(world, int) or len(shards) != world:
            return f"manifest lists {len(shards) if isinstance(shards, dict) else 'no'} shards for world size {world}"
        for name in (CheckpointDir.DCP_INDEX, CheckpointDir.DCP_META, *shards.values()):
            if name not in files:
                return f"manifest does not list {name}"
    elif CheckpointDir.MODEL not in files:
        return f"manifest does not list {CheckpointDir.MODEL}"
    for name, meta in files.items():
        f = path / name
        if not isinstance(meta, dict):
            return f"manifest's entry for {name} is not a size and sha256"
        if "/" in name or name in (".", "..") or f.is_symlink():
            return f"{name} is not a plain file of the checkpoint directory (a symlink or a path)"
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta.get("size") or _digest(f) != meta.get("sha256"):
            return f"{name} does not match its manifest (size or sha256)"
    return None


EPOCH_START = "epoch start"  # a manifest's ``position``: the train loader cannot be positioned mid-epoch
REPLAYED = "replayed"  # a manifest's ``position``: replayed to its batch, on the layout (world size) that wrote it


def passes_over(manifest: Mapping[str, Any], world: int | None = None) -> bool:
    """Whether a resume onto ``world`` ranks (None: not known, the same) passes over a checkpoint with this manifest
    for the newest at an epoch's end: taken mid-epoch, with a train loader that cannot be positioned there
    (``EPOCH_START``), or one replayed to its batch (``REPLAYED``) by another world size than ``world``: each rank's
    share of an epoch is another set of samples on another layout, so a replay per rank would train part of the epoch
    twice and part never; from the epoch's start each batch is trained once (pure)."""
    if not manifest.get("mid_epoch"):
        return False
    position, wrote = manifest.get("position"), manifest.get("world_size")
    return position == EPOCH_START or (position == REPLAYED and world is not None and wrote is not None and
                                       wrote != world)


def passed_over(path: Path, world: int | None = None) -> bool:
    """``passes_over`` for the checkpoint at ``path``."""
    return passes_over(manifest_of(path), world)


def latest(root: Path, config_hash: str | None = None, force: bool = False,
           check: bool = False, positioned: bool = False, world: int | None = None) -> tuple[int, Path] | None:
    """The newest complete checkpoint; with ``check``, damaged ones are skipped for the previous one; with
    ``positioned``, ``passed_over`` ones too for a resume onto ``world`` ranks (the previous one is at an epoch's end:
    runner writes one at each epoch's end for such a loader, and ``prune`` keeps the newest)."""
    for step, path in complete(root, config_hash, force):
        if positioned and passed_over(path, world):
            log.info("passing over %s: taken mid-epoch, with a train loader that cannot be positioned there on %s "
                     "ranks", path, world if world is not None else "these")
            continue
        problem = verify(path) if check else None
        if problem is None:
            return step, path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, problem)
    return None


def mark_unloadable(path: Path, why: str) -> None:
    """Rank 0: the checkpoint at ``path`` verified yet failed to load (its files match a manifest that is wrong, a
    state that no longer fits): ``verify`` says so from now on, so every later resume skips it for the previous one,
    as it skips a damaged one, and none tries it again. Removing the file lets it be tried again."""
    atomic_write(CheckpointDir.unloadable(path), json.dumps({"why": why, "time": round(time.time(), 3)}) + "\n")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish(root: Path, step: int, manifest: CheckpointManifest) -> Path:
    """Turn a fully written staging directory into ``step-XXXXXXX`` and mark it complete (rank 0 only).

    The manifest records each file's size and sha256 as read back from disk, so a resume can tell a checkpoint
    that was damaged after it was written (a full disk, a bad copy) from a good one.
    """
    ckpts = CheckpointDir(root)
    staging, final = ckpts.staging(step), ckpts.step(step)
    known: dict[str, Any] = {}  # a sharded checkpoint's shards, each hashed by the rank that wrote it
    manifest = manifest.copy()
    if manifest.get("format") == SHARDED:
        shards = {}
        for rank in range(int(manifest["world_size"])):
            got = read_json(CheckpointDir.digest(staging, rank), {}) or {}
            shards[str(rank)] = got["name"]
            known[got["name"]] = {"size": got["size"], "sha256": got["sha256"]}
            CheckpointDir.digest(staging, rank).unlink()
        manifest["shards"] = shards
    manifest["files"] = {p.name: known.get(p.name) or {"size": p.stat().st_size, "sha256": _digest(p)}
                         for p in sorted(staging.iterdir()) if p.is_file()}
    # This write fsyncs the staging directory, and with it the names of the other ranks' files.
    atomic_write(CheckpointDir.manifest(staging), json.dumps(manifest, indent=2, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    atomic_write(CheckpointDir.marker(final), f"{step}\n")
    return final


def manifest_of(path: Path) -> CheckpointManifest:
    """The manifest of the checkpoint at ``path``, as its type (``runner.records``); {} when missing or damaged (said
    once)."""
    return records.checkpoint_manifest(read_json(CheckpointDir.manifest(path), {}))


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds one shard per rank (its manifest's format)."""
    return bool(manifest_of(path).get("format") == SHARDED)


def write_digests(staging: Path, rank: int) -> None:
    """Hash this rank's shard (DCP names it ``__RANK_N.distcp``) and leave the result for rank 0: the ranks hash
    in parallel, and no rank reads another's shard."""
    found = CheckpointDir.shards(staging, rank)
    if len(found) != 1:
        raise RuntimeError(f"rank {rank} wrote {len(found)} shard files into {staging}, expected 1")
    f = found[0]
    atomic_write(CheckpointDir.digest(staging, rank), json.dumps({"name": f.name, "size": f.stat().st_size,
                                                         "sha256": _digest(f)}), sync_dir=False)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints, and the newest at an epoch's end (where a resume goes back to
    when the loader cannot be positioned mid-epoch); remove older ones and abandoned staging dirs. One that failed to
    load (``mark_unloadable``) is left as it is, for a person to look at, and not counted."""
    found = [(step, path) for step, path in complete(root) if not CheckpointDir.unloadable(path).exists()]
    epoch_end = next((path for _, path in found if manifest_of(path).get("mid_epoch") is False), None)
    for _, path in found[keep:]:
        if path != epoch_end:
            shutil.rmtree(path, ignore_errors=True)
    newest = found[0][0] if found else -1
    for step, path in CheckpointDir(root).stagings():
        if step < newest:
            shutil.rmtree(path, ignore_errors=True)


def wait_for_files(paths: list[Path], timeout_s: float) -> list[Path]:
    """Wait until every path exists (written by other ranks, maybe on other nodes); returns the missing ones."""
    deadline = time.monotonic() + timeout_s
    missing = [p for p in paths if not p.exists()]
    while missing and time.monotonic() < deadline:
        time.sleep(0.05)
        missing = [p for p in missing if not p.exists()]
    return missing


class Writer:
    """Writes one checkpoint at a time in a background thread, so training goes on while it is written.

    ``submit`` first waits for the previous write (never two in flight), then starts the next one; ``wait``
    re-raises a write's error on the training thread. A process killed mid-write leaves a staging directory
    without ``COMPLETE``: the previous checkpoint stays the newest complete one.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="runner-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def remove_staging(root: Path) -> None:
    """Remove every staging directory: called before an attempt's first write, they are a dead attempt's."""
    for _, path in CheckpointDir(root).stagings():
        shutil.rmtree(path, ignore_errors=True)
