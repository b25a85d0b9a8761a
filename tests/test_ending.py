"""One end-of-attempt path for Slurm's exit hook and the local driver (runner.host.ending): the cause from the run's
own files, and one write of the exit status and the ledger's exit, whichever scheduler saw the ranks end."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from runner.alerts.causes import RankExit, srun_exits
from runner.host import ending
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

RAISED = {"type": "RuntimeError", "message": "injected fault", "frame": "train.py:9 in step", "step": 12, "time": 2.0}
ECHO = {"type": "DistBackendError", "message": "Connection closed by peer", "frame": "x.py:1 in f", "step": 12,
        "time": 1.0}
HANG = {"attempt": 1, "summary": "rank 1 on n2 is not responding (in backward)", "suspects": [[1, "n2"]], "world": 2,
        "nodes": ["n2"]}
PREFLIGHT = {"summary": "preflight fail: 1 of 4 checks failed", "nodes": ["n1", "n2"],
             "checks": [{"name": "gpus", "status": "fail", "node": "n2"}, {"name": "gpus", "status": "pass",
                                                                           "node": "n1"}]}
PREFLIGHT_ALL = {**PREFLIGHT, "checks": [{"name": "gpus", "status": "fail", "node": "n1"},
                                         {"name": "gpus", "status": "fail", "node": "n2"}]}
NAN = [{"event": "nonfinite", "step": 7, "what": "loss"}]
SRUN_KILLED = srun_exits(["srun: error: n2: task 1: Killed", "srun: error: n1: task 0: Exited with exit code 1"])
LOCAL_RAISED = [RankExit(0, 1, 1.0, "vm"), RankExit(1, 1, 2.0, "vm")]


def run_dir(tmp_path: Path, crashes: dict[int, dict[str, Any]] | None = None, hang: dict[str, Any] | None = None,
            preflight: dict[str, Any] | None = None) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.attempt_logs(1).mkdir(parents=True)
    for rank, crash in (crashes or {}).items():
        run.crash_file(1, rank).write_text(json.dumps(crash))
    if hang is not None:
        run.hang.write_text(json.dumps(hang))
    if preflight is not None:
        run.preflight.write_text(json.dumps(preflight))
    return run


# (event, what the attempt left, rank exits as its scheduler saw them) -> (cause sentence, kind, rank, bad nodes)
CASES = [
    ("failed", {"crashes": {0: ECHO}}, SRUN_KILLED, ("rank 1 on n2: killed (srun: Killed)", "rank", 1, [])),
    ("failed", {"crashes": {0: ECHO, 1: RAISED}}, LOCAL_RAISED,
     ("rank 1 on vm: Python exception: RuntimeError: injected fault at train.py:9 in step, step 12", "rank", 1, [])),
    ("failed", {"crashes": {1: RAISED}}, [],  # no scheduler saw a rank end: the earliest crash record
     ("Python exception: RuntimeError: injected fault at train.py:9 in step, step 12", "exception", None, [])),
    ("failed", {}, [], (None, None, None, [])),  # nothing seen: the alert guesses from the logs
    # resume.in_job: a step node Slurm reports down ended it, not its peers' connection errors (nor rank 1's kill)
    ("failed", {"crashes": {0: ECHO}, "lost": ["n2"]}, SRUN_KILLED,
     ("node failure: Slurm reports n2 down", "node_failure", 1, [])),
    # ... or the step reaper found silent after its peers failed, before Slurm's word
    ("failed", {"crashes": {0: ECHO}, "lost": ["n2"], "reaped": ["n2"]}, SRUN_KILLED,
     ("node failure: n2 lost: no heartbeat after the other ranks failed", "node_failure", 1, [])),
    ("hang", {"hang": HANG}, [RankExit(0, 79, 1.0, "n1")],
     ("rank 1 on n2 is not responding (in backward)", "hang", 0, ["n2"])),
    ("hang", {"hang": {**HANG, "attempt": 3}}, [RankExit(0, 79, 1.0, "n1")],  # an older attempt's report: not this
     ("rank 0 on n1: exit 79", "rank", 0, [])),
    ("preflight_failed", {"preflight": PREFLIGHT}, [],
     ("node: n2 failed the preflight: preflight fail: 1 of 4 checks failed", "bad_nodes", None, ["n2"])),
    ("preflight_failed", {"preflight": PREFLIGHT_ALL}, [],  # every node failed: the job, not a node
     ("preflight fail: 1 of 4 checks failed", None, None, [])),
    ("preflight_failed", {}, [], ("preflight failed; see preflight.txt", None, None, [])),
    ("nan", {}, [], ("nan: non-finite loss at step 7; training stopped before any checkpoint of it", "nan", None, [])),
    ("completed", {}, [RankExit(0, 0), RankExit(1, 0)], (None, None, None, [])),
    # a notice's end is the notice, never a guess from the log's last lines (a program's command line, say)
    ("preempted", {}, [RankExit(0, 75), RankExit(1, -signal.SIGTERM, 2.0, "vm")],
     ("preemption: the notice came and the ranks stopped to be requeued", "preemption", None, [])),
    ("preempted:USR2", {}, [], ("preemption: the notice (SIGUSR2) came and the ranks stopped to be requeued",
                                "preemption", None, [])),
    ("timeout:USR2", {}, [], ("time limit: the notice (SIGUSR2) came and the ranks stopped to be requeued",
                              "time_limit", None, [])),
]


@pytest.mark.parametrize(("event", "left", "exits", "want"), CASES)
def test_the_cause_is_the_same_whichever_scheduler_saw_the_end(tmp_path: Path, event: str, left: dict[str, Any],
                                                              exits: list[RankExit], want: tuple[Any, ...]) -> None:
    left = dict(left)
    lost = left.pop("lost", [])  # the step's nodes Slurm reports down, where the exit hook asked
    reaped = left.pop("reaped", [])  # ... those of them the step reaper found lost
    run = run_dir(tmp_path, **left)
    event, _, notice = event.partition(":")  # the signal the batch shell got, where the exit hook knows it
    w = ending.why(run, event, 1, NAN if event == "nan" else [], exits, notice=notice or None, lost=lost,
                   reaped=reaped)
    assert (w.sentence, w.cause.kind if w.cause else None, w.rank, w.bad) == want
    fields = ending.alert_fields(run, w, 1)
    assert fields.get("cause") == want[0] and fields.get("cause_kind") == want[1]
    assert ("log_tail" in fields) == (want[2] is not None)  # the failing rank's own log, not rank 0's echo


def test_the_end_is_written_once_with_the_url_redacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = "https://hooks.example.invalid/services/T0/B0/secret-token"
    monkeypatch.setenv("RUNNER_TEST_ENDING_HOOK", url)
    run = run_dir(tmp_path)
    section = {"enabled": True, "kind": "slack", "url_env": "RUNNER_TEST_ENDING_HOOK", "url_file": None}
    ending.record(run, section, {"job_id": "7", "exit_code": 1, "signal": "none", "outcome": "failed", "attempt": 1,
                                 "cause": f"program: posted to {url}", "crash": None, "nodes": []})
    status = run.exit_status_record()
    assert status is not None and (status["exit_code"], status.get("event"), status.get("job_id")) == (1, "failed", "7")
    [exit_event] = [e for e in run.events() if e["event"] == "exit"]
    assert exit_event["outcome"] == "failed" and exit_event["attempt"] == 1
    assert url not in run.ledger.read_text() and "secret-token" not in run.ledger.read_text()
