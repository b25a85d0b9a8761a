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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.rundir import atomic_write, read_json

_STEP = re.compile(r"^step-(\d{7,})$")
MARKER = "COMPLETE"
MODEL = "model.ckpt"
MANIFEST = "manifest.json"  # step, time, config hash, files and their digests; written last, before MARKER
SHARDED = "dcp"  # manifest "format" of a sharded checkpoint: torch distributed checkpoint files, one per rank
DCP_METADATA, DCP_META = ".metadata", "meta.pt"  # DCP's index of the shards; Lightning's non-tensor state
log = logging.getLogger(__name__)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def staging_dir(root: Path, step: int) -> Path:
    """Where ranks write before the checkpoint is published by a rename (invisible to readers)."""
    return root / f".staging-step-{step:07d}"


def complete(root: Path, config_hash: str | None = None, force: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints, newest first; incomplete ones and ones of another config are skipped loudly."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        m = _STEP.match(path.name)
        if not m:
            continue
        if not (path / MARKER).is_file():
            log.warning("skipping %s: no %s marker (a write that never finished)", path, MARKER)
            continue
        manifest = manifest_of(path)
        if config_hash and manifest.get("config_hash") != config_hash and not force:
            log.warning("skipping %s: written by config %s, this run is %s (resume.force=true overrides)", path,
                        manifest.get("config_hash"), config_hash)
            continue
        found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def verify(path: Path) -> str | None:
    """None if every file matches the manifest's size and sha256, else what is wrong.

    A manifest must list the model, and every file must be a plain file inside the checkpoint directory: a
    symlink (or a name with ``..``) could make a damaged or foreign file look verified.
    """
    manifest = manifest_of(path)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    if manifest.get("format") == SHARDED:
        shards = manifest.get("shards")
        world = manifest.get("world_size")
        if not isinstance(shards, dict) or not isinstance(world, int) or len(shards) != world:
            return f"manifest lists {len(shards) if isinstance(shards, dict) else 'no'} shards for world size {world}"
        for name in (DCP_METADATA, DCP_META, *shards.values()):
            if name not in files:
                return f"manifest does not list {name}"
    elif MODEL not in files:
        return f"manifest does not list {MODEL}"
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


def latest(root: Path, config_hash: str | None = None, force: bool = False,
           check: bool = False) -> tuple[int, Path] | None:
    """The newest complete checkpoint; with ``check``, damaged ones are skipped for the previous one."""
    for step, path in complete(root, config_hash, force):
        problem = verify(path) if check else None
        if problem is None:
            return step, path
        log.warning("skipping %s: %s; trying the previous checkpoint", path, problem)
    return None


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish(root: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Turn a fully written staging directory into ``step-XXXXXXX`` and mark it complete (rank 0 only).

    The manifest records each file's size and sha256 as read back from disk, so a resume can tell a checkpoint
    that was damaged after it was written (a full disk, a bad copy) from a good one.
    """
    staging, final = staging_dir(root, step), step_dir(root, step)
    known: dict[str, Any] = {}  # a sharded checkpoint's shards, each hashed by the rank that wrote it
    if manifest.get("format") == SHARDED:
        shards = {}
        for rank in range(int(manifest["world_size"])):
            got = read_json(digest_file(staging, rank), {}) or {}
            shards[str(rank)] = got["name"]
            known[got["name"]] = {"size": got["size"], "sha256": got["sha256"]}
            digest_file(staging, rank).unlink()
        manifest = {**manifest, "shards": shards}
    manifest = {**manifest, "files": {p.name: known.get(p.name) or {"size": p.stat().st_size, "sha256": _digest(p)}
                                      for p in sorted(staging.iterdir()) if p.is_file()}}
    # This write fsyncs the staging directory, and with it the names of the other ranks' files.
    atomic_write(staging / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    atomic_write(final / MARKER, f"{step}\n")
    return final


def manifest_of(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; {} when missing or damaged (said once)."""
    found = read_json(path / MANIFEST, {})
    return found if isinstance(found, dict) else {}


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds one shard per rank (its manifest's format)."""
    return bool(manifest_of(path).get("format") == SHARDED)


def digest_file(staging: Path, rank: int) -> Path:
    """Where a rank leaves the size and sha256 of the shard it wrote, for rank 0's manifest."""
    return staging / f"shard-rank{rank:05d}.json"


def write_digests(staging: Path, rank: int) -> None:
    """Hash this rank's shard (DCP names it ``__RANK_N.distcp``) and leave the result for rank 0: the ranks hash
    in parallel, and no rank reads another's shard."""
    found = sorted(staging.glob(f"__{rank}_*.distcp"))
    if len(found) != 1:
        raise RuntimeError(f"rank {rank} wrote {len(found)} shard files into {staging}, expected 1")
    f = found[0]
    atomic_write(digest_file(staging, rank), json.dumps({"name": f.name, "size": f.stat().st_size,
                                                         "sha256": _digest(f)}), sync_dir=False)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove older ones and abandoned staging dirs."""
    found = complete(root)
    for _, path in found[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    newest = found[0][0] if found else -1
    for path in root.glob(".staging-step-*"):
        m = re.search(r"(\d+)$", path.name)
        if m and int(m.group(1)) < newest:
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
    for path in root.glob(".staging-step-*"):
        shutil.rmtree(path, ignore_errors=True)
