"""Fuzzing, the unit tier: hostile ledgers and run directories read in process (the config path through the CLI:
tests/test_fuzz.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_fuzz import COUNTS, REPO, SCALE, call, counted_call

pytestmark = pytest.mark.unit


RUN_FILES = ["manifest.json", "config.yaml", "job_id", "ledger.jsonl", "exit_status.json", "progress.json", "finished",
             "successor.json", "hang.json", "preflight.json", "last_exit.json", "cancelled",
             "checkpoints/step-0000010/manifest.json", "checkpoints/step-0000010/COMPLETE",
             "logs/attempt-1/crash-00000.json", "logs/attempt-1/rank-00000.log", "heartbeats/rank-00000.json",
             "hangs/attempt-1/rank-00000.json", "alerts/queue/20260101T000000.000000000Z-failed.json",
             "alerts/sent.jsonl", "parallel/chunks/chunk-000000.json", "parallel/driver.json", "program/fuzz.yaml"]


WRONG_SHAPES = ["null", "[]", "[1, 2]", "7", '"x"', "true", '{"step": null}', '{"files": 5}', '{"files": {"a": 5}}',
                '{"results": [1], "failed": 3}', '{"results": {"x": 1}}', '{"chunk": 9, "results": {"999": 1}}',
                '{"time": "now", "event": 5}', '{"scheduler": ["slurm"]}', '{"config_hash": {}}',
                '{"job_id": {"a": 1}, "after": null}', '{"created": "yesterday"}', '{"productive_s": "7"}',
                '{"stalled_s": null, "attempt": "1"}', "[" * 5000 + "]" * 5000, "{{{", "\xff\xfe", "",
                "slurm: [\n", "- 1\n- 2\n", "trainer: 5\n", "name: [x]\nnum_nodes: '2'\n", "12_x\n",
                "99999999999999999999\n"]


DAMAGE = st.sampled_from(["fifo", "dir", "huge", "symlink-loop"]) | st.sampled_from(WRONG_SHAPES)


RUN_COMMANDS = [["status", "--json"], ["status"], ["status", "RUN", "--json"], ["status", "RUN", "--ranks"],
                ["logs", "RUN"], ["logs", "RUN", "--batch"], ["report", "RUN", "--out", "OUT"], ["resume", "RUN"],
                ["cancel", "RUN"], ["cron"]]


def _run_dir(root: Path) -> Path:
    """A Slurm run as submit and the exit hook leave a failed job, with a checkpoint, a crash and a parallel chunk."""
    from runner.host import submit

    p = submit.write(submit.plan(REPO / "conf" / "quickstart.yaml", [f"run_root={root}", "scheduler=slurm",
                                                                     "container.runtime=none", "name=fz"]))
    run = p.run
    run.job_id_file.write_text("100\n")
    for event in ("submitted", "start"):
        run.record(event, job_id="100")
    run.record("exit", job_id="100", exit_code=1, outcome="failed", attempt=1)
    run.exit_status.write_text('{"exit_code": 1, "job_id": "100", "event": "failed"}\n')
    for name in RUN_FILES:
        path = run.root / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n" if name.endswith(".json") else "x\n")
    return run.root


def _damage(path: Path, how: str) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        path.mkdir()
    elif how == "huge":
        with open(path, "wb") as f:
            f.truncate(3 << 30)  # sparse: never read whole
    elif how == "symlink-loop":
        path.symlink_to(path)
    else:
        path.write_bytes(how.encode("utf-8", "surrogateescape") if how != "\xff\xfe" else b"\xff\xfe")


def _recorded_slurm(argv: list[str], timeout: float = 60, check: bool = True, **kw: Any) -> \
        subprocess.CompletedProcess[str]:
    """Slurm's commands answered with recorded output: job 100 ended FAILED (tests/fixtures/slurm's row format);
    sbatch hands out job 1000; nothing else is run."""
    out = {"sacct": "100|FAILED|1:0|n1|2026-11-22T13:12:50|2026-11-22T13:12:50|00:00:00\n", "sbatch": "1000\n"}
    return subprocess.CompletedProcess(argv, 0, out.get(argv[0], ""), "")


def run_fuzz_once(template: Path, root: Path, files: list[tuple[str, str]], command: list[str]) -> None:
    run = root / template.name
    shutil.copytree(template, run, symlinks=True)
    for name, how in files:  # a 3 GiB log is a log: `runner logs` would print it (streamed), not a damaged file
        _damage(run / name, "[]" if how == "huge" and name.endswith(".log") else how)
    argv = [a.replace("RUN", str(run)).replace("OUT", str(root / "page.html")) for a in command]
    argv += ["--root", str(root)]
    try:
        answer = counted_call("run files", argv)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if answer is None:
        return
    rc, out, err = answer
    assert "Traceback" not in err + out, err
    assert rc in (0, 1, 2), (rc, err)


# Ledger lines that `status` took and `report`/`resume` tripped over (issue 39): times no date is made of, a line
# nested past Python's depth, a time that is a bool.
HOSTILE_LEDGER_LINES = ['{"event": "exit", "time": 1e308, "attempt": 1, "exit_code": 1}',
                        '{"event": "start", "time": Infinity, "attempt": 2}', '{"event": "exit", "time": -1e308}',
                        '{"event": "exit", "time": NaN, "attempt": 1}', '{"event": "start", "time": true}',
                        '{"event": "x", "time": 1, "deep": ' + "[" * 2000 + "]" * 2000 + "}",
                        '{"event": "exit", "time": 1795743981.6, "attempt": 1, "exit_code": 1e309, "step": -1e400}']


@pytest.mark.parametrize("line", HOSTILE_LEDGER_LINES)
def test_a_hostile_ledger_line_never_a_traceback(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Appended to a real run's ledger, under every command that reads it: a line that is not ours is skipped."""
    from runner import proc

    monkeypatch.setattr(proc, "run", _recorded_slurm)
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    template = _run_dir(tmp_path / "template")
    with (template / "ledger.jsonl").open("a") as f:
        f.write(line + "\n")
    for command in RUN_COMMANDS:
        root = tmp_path / "runs"
        run = root / template.name
        shutil.copytree(template, run, symlinks=True)
        argv = [a.replace("RUN", str(run)).replace("OUT", str(root / "page.html")) for a in command]
        try:
            rc, out, err = call([*argv, "--root", str(root)])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        assert "Traceback" not in out + err and rc in (0, 1, 2), (command, rc, err)


@pytest.mark.parametrize("damage, said", [
    ("truncated manifest", "manifest.json is missing or unreadable"), ("no manifest", "manifest.json is missing"),
    ("logs is a file", "logs is a file; expected a directory")])
def test_resume_refuses_a_damaged_run_before_any_rank_starts(damage: str, said: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What every rank reads first is checked before a job is submitted: no resubmission, one line."""
    from runner import proc

    calls: list[list[str]] = []
    monkeypatch.setattr(proc, "run", lambda argv, *a, **kw: calls.append(argv) or _recorded_slurm(argv, *a, **kw))
    run = _run_dir(tmp_path / "runs")
    if damage == "truncated manifest":
        run.joinpath("manifest.json").write_text(run.joinpath("manifest.json").read_text()[:60])
    elif damage == "no manifest":
        run.joinpath("manifest.json").unlink()
    else:
        shutil.rmtree(run / "logs")
        (run / "logs").write_text("x\n")
    rc, out, err = call(["resume", str(run)])
    assert rc == 1 and said in err and "Traceback" not in err, (rc, err)  # refused, as a live job is
    assert [line for line in err.splitlines() if line.startswith("runner: error:")] == [err.splitlines()[-1]]
    assert not [c for c in calls if c[0] == "sbatch"] and "resubmitted" not in run.joinpath("ledger.jsonl").read_text()


def test_fuzz_run_directories_never_a_traceback_or_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run file a command reads (manifests, config, job_id, ledger, progress, checkpoint and chunk files, crash
    records, queues), as wrong-shape JSON, bytes that are not UTF-8, deep nesting, a FIFO, a folder, a 3 GiB sparse
    file or a symlink loop, under status, logs, report, resume, cancel and cron (Slurm's answers recorded). Any
    exit but a traceback; a FIFO that was opened would hang the test."""
    from runner import proc

    monkeypatch.setattr(proc, "run", _recorded_slurm)
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    template = _run_dir(tmp_path / "template")
    t0 = time.monotonic()

    @settings(max_examples=int(300 * SCALE), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(files=st.lists(st.tuples(st.sampled_from(RUN_FILES), DAMAGE), min_size=1, max_size=3),
           command=st.sampled_from(RUN_COMMANDS))
    def run(files: list[tuple[str, str]], command: list[str]) -> None:
        if time.monotonic() - t0 > 60 * float(os.environ.get("RUNNER_FUZZ_BUDGET", "1")):
            COUNTS["run files: over budget, not run"] += 1
            return
        run_fuzz_once(template, tmp_path / "runs", files, command)

    run()
    print(f"fuzz run files: {dict(sorted((k, v) for k, v in COUNTS.items() if k.startswith('run files')))} in "
          f"{time.monotonic() - t0:.1f} s")
    assert not [k for k in COUNTS if k.startswith("run files: traceback")]
    assert COUNTS["run files: cases"] >= min(100, 300 * SCALE)
