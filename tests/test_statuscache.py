"""`runner status`'s memory of each run's row (runner.host.statuscache, issue 39): when a remembered row still answers,
as a table, and that a memory that is stale, damaged, of other code or racing with a writer never shows a wrong row
(each case against the rows read afresh at the same clock). The time it saves: bench/status_local."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint import CheckpointDir
from runner.host import status, statuscache
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

NOW = round(time.time())  # the clock of every look (frozen); a file written during a test is newer
T0 = NOW - 7200.0  # the runs' submission, two hours before


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)


def _line(t: float, event: str, **fields: Any) -> str:
    return json.dumps({"time": t, "event": event, **fields}, sort_keys=True) + "\n"


def local_run(root: Path, name: str, finished: bool) -> RunDir:
    """A local run that trained 600 s and finished, or failed with a cause after its checkpoint of step 30; its
    files written an hour ago."""
    run = RunDir(root / name)
    run.root.mkdir(parents=True)
    run.config.write_text("scheduler: local\n")
    run.manifest.write_text(json.dumps({"scheduler": "local", "config_hash": "x", "created": T0}))
    lines = [_line(T0, "submitted", scheduler="local", world_size=2),
             _line(T0 + 10, "train_start", step=0, lost_steps=0, attempt=1, resumed_from=None)]
    if finished:
        lines.append(_line(T0 + 610, "finished", step=60))
        run.finished.write_text(json.dumps({"step": 60, "time": T0 + 610, "productive_s": 500.0}))
    lines.append(_line(T0 + 611, "exit", outcome="completed" if finished else "failed", exit_code=0 if finished else 1,
                       attempt=1, cause=None if finished else "rank 0: boom"))
    run.ledger.write_text("".join(lines))
    checkpoint(run, 60 if finished else 30)
    run.exit_status.write_text(json.dumps({"exit_code": 0 if finished else 1, "event": "completed" if finished
                                           else "failed", "attempt": 1, "time": T0 + 611, "codes": [1, 1]}))
    backdate(run)
    return run


def checkpoint(run: RunDir, step: int, complete: bool = True) -> Path:
    """A published checkpoint (its marker comes last)."""
    path = CheckpointDir(run.checkpoints).step(step)
    path.mkdir(parents=True)
    CheckpointDir.manifest(path).write_text(json.dumps({"step": step, "config_hash": "x", "productive_s": 5.0 * step}))
    if complete:
        CheckpointDir.marker(path).write_text(f"{step}\n")
    return path


def backdate(run: RunDir, seconds: float = 3600.0) -> None:
    """Every file and folder of the run last changed ``seconds`` before NOW (out of RACY_S)."""
    when = NOW - seconds
    for dirpath, dirs, files in os.walk(run.root, topdown=False):
        for p in [*files, *dirs]:
            os.utime(os.path.join(dirpath, p), (when, when))
    os.utime(run.root, (when, when))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    local_run(root, "done", finished=True)
    local_run(root, "failed", finished=False)
    return root


def afresh(root: Path) -> list[dict[str, Any]]:
    """The rows as runner reads them without any memory."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(statuscache, "load", lambda root: statuscache.Memory(root, "none"))
        m.setattr(statuscache.Memory, "save", lambda self, names: None)
        return status.collect(None, root)


def remembered(root: Path) -> set[str]:
    return set(statuscache.load(root).entries)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The runs whose ledger was read."""
    got: list[str] = []
    events = RunDir.events

    def counted(self: RunDir) -> list[dict[str, Any]]:
        got.append(self.name)
        return events(self)

    monkeypatch.setattr(RunDir, "events", counted)
    yield got


# ---------------------------------------------------------------------------------------------------------------
# The decision, as a table


STATS: list[statuscache.Stat] = [[1, 10, 5, 5], None]
ENTRY = {"stats": statuscache.digest(STATS), "local": True, "row": {"state": "failed"}}


@pytest.mark.parametrize("entry, stats, alive, answers, asked", [
    (ENTRY, STATS, False, True, True),  # same files, no process lives: the row answers
    (ENTRY, [[1, 11, 5, 5], None], False, False, False),  # the ledger grew
    (ENTRY, [[2, 10, 5, 5], None], False, False, False),  # replaced (a new inode, same size and time)
    (ENTRY, [[1, 10, 5, 6], None], False, False, False),  # changed in place within one tick (its ctime)
    (ENTRY, [[1, 10, 5, 5], [3, 1, 1, 1]], False, False, False),  # a file appeared (finished, cancelled, job_id)
    (ENTRY, None, False, False, False),  # a file cannot be looked at
    (ENTRY, STATS, True, False, True),  # a process of the local run lives again (a resume): read again
    ({**ENTRY, "row": {"state": "completed"}}, STATS, True, True, False),  # its state does not depend on it
    ({**ENTRY, "row": {"state": "cancelled"}}, STATS, True, True, False),
    ({**ENTRY, "local": False}, STATS, True, True, False),  # a Slurm run settled by its records
    ({**ENTRY, "row": {"state": 3}}, STATS, False, False, False),  # a damaged row
    ({**ENTRY, "row": "failed"}, STATS, False, False, False),
    ({k: v for k, v in ENTRY.items() if k != "row"}, STATS, False, False, False),
    ("garbage", STATS, False, False, False),
    (None, STATS, False, False, False),
], ids=["same", "grew", "replaced", "same-tick", "appeared", "unreadable", "alive", "completed-alive",
        "cancelled-alive", "slurm", "bad-state", "bad-row", "no-row", "not-an-entry", "none"])
def test_a_remembered_row_answers_only_while_nothing_it_depends_on_changed(
        entry: Any, stats: list[statuscache.Stat] | None, alive: bool, answers: bool, asked: bool) -> None:
    calls: list[bool] = []

    def lives() -> bool:
        calls.append(alive)
        return alive

    assert statuscache.fresh(entry, stats, lives) is answers
    assert bool(calls) is asked, "the owner lock is asked only where the state depends on it"


@pytest.mark.parametrize("age_s, racy", [(0.0, True), (1.9, True), (2.1, False), (3600.0, False)])
def test_a_run_changed_within_racy_s_is_never_remembered(age_s: float, racy: bool) -> None:
    mtime = int((NOW - age_s) * 1e9)
    assert statuscache.Signature([], [None, [1, 2, mtime, mtime]]).racy(NOW) is racy
    assert not statuscache.Signature([], [None, None]).racy(NOW)


# ---------------------------------------------------------------------------------------------------------------
# runner status over a root, with its memory


def test_a_listing_reads_again_only_the_runs_that_changed(root: Path, reads: list[str]) -> None:
    first = status.collect(None, root)
    assert sorted(reads) == ["done", "failed"] and remembered(root) == {"done", "failed"}
    assert first == afresh(root)
    reads.clear()
    assert status.collect(None, root) == first and reads == [], "nothing changed: nothing read"
    failed = RunDir(root / "failed")
    with failed.ledger.open("a") as f:
        f.write(_line(NOW - 5, "cancelled", job_id=None))
    reads.clear()
    rows = {r["run"]: r for r in status.collect(None, root)}
    assert reads == ["failed"] and rows["failed"]["state"] == "cancelled"
    assert remembered(root) == {"done"}, "changed within RACY_S: read again next time too"
    backdate(failed)
    assert list(rows.values()) == afresh(root) == status.collect(None, root)
    assert remembered(root) == {"done", "failed"}


def test_an_unfinished_runs_goodput_runs_on_to_now(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                   reads: list[str]) -> None:
    """A failed run's wall time grows with the clock (stopped for a person): its remembered attempts give it anew."""
    before = {r["run"]: r for r in status.collect(None, root)}
    monkeypatch.setattr(time, "time", lambda: NOW + 86400)
    reads.clear()
    later = status.collect(None, root)
    assert reads == [] and later == afresh(root)
    rows = {r["run"]: r for r in later}
    assert rows["failed"]["wall_s"] == before["failed"]["wall_s"] + 86400
    assert rows["failed"]["goodput"] < before["failed"]["goodput"]
    assert rows["failed"]["age_s"] == before["failed"]["age_s"] + 86400
    assert rows["done"]["wall_s"] == before["done"]["wall_s"], "a finished run's wall time ended with training"


def test_a_local_run_whose_process_lives_again_is_read_again(root: Path) -> None:
    status.collect(None, root)
    failed = RunDir(root / "failed")
    fd = os.open(failed.owner_lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a resumed run's driver holds it, before its ledger says so
        rows = {r["run"]: r for r in status.collect(None, root)}
        assert rows["failed"]["state"] == "running" and rows["done"]["state"] == "completed"
        assert remembered(root) == {"done"}, "a running run is never remembered"
    finally:
        os.close(fd)
    backdate(failed)
    assert status.collect(None, root) == afresh(root) and afresh(root)[1]["state"] == "failed"


def _rewrite(path: Path, old: str, new: str) -> None:
    """Change a file in place, same size, and put its modification time back (an editor, a clock of 1 s)."""
    st = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    with path.open("r+") as f:
        f.write(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _sum_body(path: Path, change: Any) -> None:
    """Rewrite the memory's rows through ``change`` with a checksum that matches (a hand edit that knows how)."""
    head, body = path.read_bytes().split(b"\n", 1)
    runs = change(json.loads(body))
    body = json.dumps(runs).encode()
    meta = json.loads(head)
    meta["sum"] = statuscache.hashlib.blake2b(body).hexdigest()
    path.write_bytes(json.dumps(meta).encode() + b"\n" + body)


def _swap(runs: dict[str, Any]) -> dict[str, Any]:
    runs["done"]["row"], runs["failed"]["row"] = runs["failed"]["row"], runs["done"]["row"]
    return runs


DAMAGES = {
    "ledger-in-place": lambda root: _rewrite(root / "failed" / "ledger.jsonl", "rank 0: boom", "rank 1: bang"),
    "finished-appeared": lambda root: (root / "failed" / "finished").write_text(
        json.dumps({"step": 60, "time": T0 + 600, "productive_s": 400.0})),
    "manifest-torn": lambda root: (root / "done" / "manifest.json").write_text('{"scheduler": "lo'),
    "checkpoint-completed": lambda root: CheckpointDir.marker(CheckpointDir(root / "done" / "checkpoints").step(70))
    .write_text("70\n"),
    "garbage": lambda root: (root / statuscache.FILE).write_bytes(os.urandom(4096)),
    "truncated": lambda root: (root / statuscache.FILE).write_bytes(
        (root / statuscache.FILE).read_bytes()[:300]),
    "no-newline": lambda root: (root / statuscache.FILE).write_text("{}"),
    "nested-deep": lambda root: (root / statuscache.FILE).write_text('{"format": 1}\n' + "[" * 100_000),
    "row-edited": lambda root: (root / statuscache.FILE).write_bytes(
        (root / statuscache.FILE).read_bytes().replace(b'"state": "failed"', b'"state": "paused"')),
    "other-code": lambda root: (root / statuscache.FILE).write_bytes(
        (root / statuscache.FILE).read_bytes().replace(b'"code": "', b'"code": "0', 1)),
    "rows-swapped": lambda root: _sum_body(root / statuscache.FILE, _swap),
    "rows-not-objects": lambda root: _sum_body(root / statuscache.FILE, lambda runs: {n: [1, 2] for n in runs}),
    "paths-outside": lambda root: _sum_body(root / statuscache.FILE, lambda runs: {
        n: {**e, "paths": ["../../etc/passwd"]} for n, e in runs.items()}),
    "open-damaged": lambda root: _sum_body(root / statuscache.FILE, lambda runs: {
        n: {**e, "open": {"attempts": "x"}} for n, e in runs.items()}),
    "a-directory": lambda root: ((root / statuscache.FILE).unlink(), (root / statuscache.FILE).mkdir()),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_stale_or_damaged_memory_never_shows_a_wrong_row(root: Path, damage: str) -> None:
    checkpoint(RunDir(root / "done"), 70, complete=False)  # published, its marker not written yet
    backdate(RunDir(root / "done"))
    status.collect(None, root)
    assert remembered(root) == {"done", "failed"}
    DAMAGES[damage](root)
    rows = status.collect(None, root)
    assert rows == afresh(root)
    assert status.collect(None, root) == rows, "and the memory written after it is right too"


def test_a_root_where_the_memory_cannot_be_written_is_listed_all_the_same(root: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(statuscache, "atomic_write", refused)
    assert status.collect(None, root) == afresh(root) and not (root / statuscache.FILE).exists()


def test_runs_written_just_now_are_read_each_time(tmp_path: Path, reads: list[str]) -> None:
    root = tmp_path / "runs"
    run = local_run(root, "new", finished=True)
    os.utime(run.ledger)  # its ledger was just written: a second write within the clock's tick would not show
    status.collect(None, root)
    reads.clear()
    assert status.collect(None, root) == afresh(root) and reads == ["new", "new"]


def test_a_remembered_row_is_redacted_of_the_webhook_url_this_environment_knows(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An old ledger's cause quoting the URL, remembered before RUNNER_WEBHOOK_URL was set: never shown after."""
    url = "https://hooks.example.com/services/T0/B0/SECRETTOKEN123"
    failed = RunDir(root / "failed")
    with failed.ledger.open("a") as f:  # written by a runner before redaction
        f.write(_line(T0 + 612, "exit", outcome="failed", exit_code=1, attempt=1, cause=f"POST {url} refused"))
    backdate(failed)
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    assert url in str(status.collect(None, root)) and remembered(root) == {"done", "failed"}
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", url)
    rows = status.collect(None, root)
    assert url not in str(rows) and "SECRETTOKEN123" not in str(rows) and rows == afresh(root)
