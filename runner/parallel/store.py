"""A parallel run's results in its run directory: one JSON file per chunk, written atomically.

``parallel/chunks/chunk-NNNNNN.json`` holds ``{"results": {idx: value}, "failed": {idx: error}}``. A chunk file
is replaced whole (temp file, fsync, rename), so a kill, a cancel or a full disk leaves the previous version
or the new one; an item is done when its chunk file holds its result. Only the driver writes here, one chunk
at a time, so every item is in the output exactly once however often a lost worker's chunk was recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.rundir import RunDir, atomic_write, damaged, locked, read_json
from runner.spec.typed import read_resolved


@dataclass(frozen=True)
class Store:
    run: RunDir

    @property
    def root(self) -> Path:
        return self.run.parallel

    @property
    def chunks(self) -> Path:
        return self.root / "chunks"

    @property
    def result(self) -> Path:  # the workload's reduce over every item (when it has one)
        return self.root / "result.json"

    @property
    def lock(self) -> Path:  # held by the driver working on the run
        return self.root / "lock"

    @property
    def driver(self) -> Path:  # pid and host of the driver (`runner cancel` signals it)
        return self.root / "driver.json"

    def chunk_path(self, index: int) -> Path:
        return self.chunks / f"chunk-{index:06d}.json"

    def read(self, index: int) -> tuple[dict[int, Any], dict[int, str]]:
        """(results, failed) of one chunk; empty when it was never written or is damaged (see ``_load``)."""
        return self._load(self.chunk_path(index), index)

    @functools.cached_property
    def _chunk_size(self) -> int | None:
        """The run's parallel.chunk_size (which items a chunk holds); None where the config cannot tell."""
        try:
            size = read_resolved(self.run.config)["parallel"]["chunk_size"]
        except Exception:
            return None
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    def _load(self, path: Path, index: int) -> tuple[dict[int, Any], dict[int, str]]:
        """A chunk file read through its schema: ``{"chunk": index, "results": {idx: value}, "failed": {idx: error}}``
        with every idx one of this chunk's items. Anything else is damaged: said in one line, skipped as if never
        written, so a rerun computes those items again and every item is counted once."""
        data = read_json(path, {})
        results, failed = data.get("results", {}), data.get("failed", {})
        why = ""
        if data and data.get("chunk", index) != index:
            why = f"found chunk {data.get('chunk')!r} in the file of chunk {index}"
        elif not isinstance(results, dict) or not isinstance(failed, dict):
            why = "found results or failed that are not JSON objects"
        else:
            keys = [*results, *failed]
            size = self._chunk_size
            if not all(isinstance(k, str) and k.isdigit() for k in keys):
                why = "found item keys that are not item numbers"
            elif size is not None and any(int(k) // size != index for k in keys):
                why = f"found items of another chunk (chunk {index} holds {index * size} to {(index + 1) * size - 1})"
        if why:
            damaged(path, why)
            return {}, {}
        return {int(k): v for k, v in results.items()}, {int(k): str(v) for k, v in failed.items()}

    def _indexed(self) -> Iterator[tuple[int, Path]]:
        for path in self._files():
            number = path.stem.removeprefix("chunk-")
            if number.isdigit():
                yield int(number), path

    def write(self, index: int, results: dict[int, Any], failed: dict[int, str]) -> None:
        data = {"chunk": index, "results": {str(k): results[k] for k in sorted(results)},
                "failed": {str(k): failed[k] for k in sorted(failed)}}
        atomic_write(self.chunk_path(index), json.dumps(data, separators=(",", ":")) + "\n")

    def merge(self, index: int, results: dict[int, Any], failed: dict[int, str]) -> None:
        """Add a chunk's new results to what it already holds; an item that now succeeded is no longer failed."""
        old_results, old_failed = self.read(index)
        old_results.update(results)
        old_failed.update(failed)
        self.write(index, old_results, {k: v for k, v in old_failed.items() if k not in old_results})

    def _files(self) -> list[Path]:
        return sorted(self.chunks.glob("chunk-*.json")) if self.chunks.is_dir() else []

    def items(self) -> Iterator[tuple[int, Any]]:
        """Every (idx, value) done, in item order."""
        for index, path in self._indexed():
            yield from sorted(self._load(path, index)[0].items())

    def summary(self) -> tuple[int, dict[int, str]]:
        """(items done, failed items with their errors), in one pass over the chunk files."""
        done, failed = 0, {}
        for index, path in self._indexed():
            results, failures = self._load(path, index)
            done += len(results)
            failed.update(failures)
        return done, dict(sorted(failed.items()))

    def driver_alive(self) -> bool:
        """Whether a `runner parallel` holds this run's lock (a killed driver's lock is released by the kernel)."""
        if not self.lock.exists():
            return False
        with locked(self.lock, blocking=False) as held:
            return not held

    def status(self, state: str, items: int) -> dict[str, Any]:
        """`runner status` fields of a parallel run; a driver that died without a word is a failed run."""
        done, failed = self.summary()
        fields: dict[str, Any] = {"kind": "parallel", "items_total": items, "items_done": done,
                                  "items_failed": len(failed)}
        if state in ("running", "pending") and not self.driver_alive():
            fields |= {"state": "failed", "last_outcome": "failed",
                       "last_cause": "the driver is gone (killed?); run `runner parallel` again to continue"}
        return fields

    def stop_driver(self, wait_s: float) -> bool:
        """SIGTERM the driver (`runner cancel`) when it runs on this host; True once it let go of the run."""
        who = read_json(self.driver, {}) or {}
        if not self.driver_alive():
            return True
        if who.get("host") != socket.gethostname():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(who["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while self.driver_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.driver_alive()
