"""Checkpoint directories on disk: ``step-XXXXXXX/`` with a manifest and a ``COMPLETE`` marker written last.

This module is filesystem-only (no torch) so that ``runner status`` and ``runner cron`` can find the newest
complete checkpoint quickly. A directory without ``COMPLETE`` is a write that never finished: it is never used.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.rundir import atomic_write, read_json

_STEP = re.compile(r"^step-(\d{7,})$")
MARKER = "COMPLETE"


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
            print(f"runner: skipping {path}: no {MARKER} marker (a write that never finished)", file=sys.stderr)
            continue
        manifest = read_json(path / "manifest.json", {})
        if config_hash and manifest.get("config_hash") != config_hash and not force:
            print(f"runner: skipping {path}: written by config {manifest.get('config_hash')}, this run is "
                  f"{config_hash} (resume.force=true overrides)", file=sys.stderr)
            continue
        found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def latest(root: Path, config_hash: str | None = None, force: bool = False) -> tuple[int, Path] | None:
    found = complete(root, config_hash, force)
    return found[0] if found else None


def publish(root: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Turn a fully written staging directory into ``step-XXXXXXX`` and mark it complete (rank 0 only)."""
    staging, final = staging_dir(root, step), step_dir(root, step)
    atomic_write(staging / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    atomic_write(final / MARKER, f"{step}\n")
    return final


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
