"""Parsers of Slurm's output, against output recorded from a real Slurm 22.05 (tests/fixtures/slurm/).

The recordings come from `python -m tests.fixtures.slurm.record` on the dev cluster; manifest.json names
the command and the job id of each file. The ``_lag`` files were taken right after the controller changed
the job's state, before slurmdbd caught up: they are why runner asks the controller when sacct is not final.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner import proc
from runner.errors import SubmitError
from runner.host import scheduler, slurm, status
from runner.job import ifname
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())


def recorded(name: str) -> tuple[str, str]:
    """(stdout, job id) of one recording."""
    return (FIXTURES / name).read_text(), MANIFEST["files"][name]["job_id"]


def test_recordings_are_from_the_slurm_we_parse() -> None:
    assert MANIFEST["slurm_version"].startswith("slurm-wlm 22.05")
    names = {p.name for p in FIXTURES.glob("*.txt")}
    assert names <= set(MANIFEST["files"]), names - set(MANIFEST["files"])


# sacct -X -n -P -j ID --format=JobID,State,ExitCode,NodeList,Start,End,Elapsed
SACCT = {
    "COMPLETED": ("COMPLETED", "completed", "0:0", "n[1-2]"),
    "COMPLETED_lag": ("COMPLETED", "completed", "0:0", "n1"),  # the node list fills in later
    "FAILED": ("FAILED", "failed", "3:0", "n1"),
    "CANCELLED": ("CANCELLED", "cancelled", "0:0", "n1"),  # recorded as "CANCELLED by 0"
    "TIMEOUT": ("TIMEOUT", "timeout", "0:0", "n1"),
    "NODE_FAIL": ("NODE_FAIL", "failed", "0:0", "n2"),
    "RUNNING": ("RUNNING", "running", "0:0", "n1"),
    "RUNNING_lag": ("PENDING", "pending", "0:0", "n1"),  # the controller already said RUNNING
    "PENDING": ("PENDING", "pending", "0:0", None),  # NodeList "None assigned"
    "PENDING_held": ("PENDING", "pending", "0:0", None),
    "REQUEUED_PENDING": ("REQUEUED", "pending", "0:0", "n1"),
    "REQUEUED_COMPLETED": ("COMPLETED", "completed", "0:0", "n1"),
    "duplicates_REQUEUED_PENDING": ("REQUEUED", "pending", "0:0", "n1"),
    "duplicates_REQUEUED_COMPLETED": ("COMPLETED", "completed", "0:0", "n1"),
}


@pytest.mark.parametrize("name", sorted(SACCT))
def test_sacct(name: str) -> None:
    text, job = recorded(f"sacct_{name}.txt")
    info = slurm.parse_sacct(text, job)
    assert info is not None
    state, runner_state, exit_code, nodes = SACCT[name]
    assert (info.state, info.runner_state, info.exit_code, info.nodes) == (state, runner_state, exit_code, nodes)
    assert info.source == "sacct"
    assert info.terminal == (runner_state not in ("pending", "running"))
    if name.startswith("duplicates_"):  # -D: one row per attempt, the last is the current one
        assert info.restarts == 1


@pytest.mark.parametrize("name", ["PENDING_lag", "PENDING_held_lag"])
def test_sacct_before_accounting_caught_up_knows_nothing(name: str) -> None:
    text, job = recorded(f"sacct_{name}.txt")
    assert text.strip() == ""
    assert slurm.parse_sacct(text, job) is None


def test_sacct_ignores_other_jobs_and_odd_rows() -> None:
    text, job = recorded("sacct_COMPLETED.txt")
    assert slurm.parse_sacct(text, str(int(job) + 1)) is None
    assert slurm.parse_sacct("garbage\n" + text + "\n", job) is not None
    # a row with a different number of fields than asked for is not guessed at
    assert slurm.parse_sacct(text.replace("|", "|x|", 1), job) is None


def test_sacct_restarts_field_is_an_error_in_22_05() -> None:
    """Why runner does not ask sacct for Restarts: this Slurm refuses the whole query."""
    assert MANIFEST["files"]["sacct_restarts_field_error.txt"]["returncode"] == 1
    assert (FIXTURES / "sacct_restarts_field_error.txt").read_text() == ""
    stderr = (FIXTURES / "sacct_restarts_field_error.stderr").read_text()
    assert slurm.error_line(stderr) == 'Invalid field requested: "Restarts"'
    assert "Restarts" not in slurm.SACCT_FIELDS


# squeue -h -t all -j ID -o '%i|%T|%r|%N'
SQUEUE = {
    "COMPLETED": ("COMPLETED", None, "n[1-2]"),
    "FAILED": ("FAILED", "NonZeroExitCode", "n1"),
    "CANCELLED": ("CANCELLED", None, "n1"),
    "TIMEOUT": ("TIMEOUT", "TimeLimit", "n1"),
    "NODE_FAIL": ("NODE_FAIL", "NodeDown", "n2"),
    "RUNNING": ("RUNNING", None, "n1"),
    "PENDING": ("PENDING", "Resources", None),
    "PENDING_held": ("PENDING", "JobHeldUser", None),
    "REQUEUED_PENDING": ("PENDING", "BeginTime", None),
    "REQUEUED_COMPLETED": ("COMPLETED", None, "n1"),
}


@pytest.mark.parametrize("name", sorted(SQUEUE))
def test_squeue(name: str) -> None:
    text, job = recorded(f"squeue_{name}.txt")
    info = slurm.parse_squeue(text, job)
    assert info is not None and info.source == "squeue"
    assert (info.state, info.reason, info.nodes) == SQUEUE[name]
    assert slurm.parse_squeue(text, job + "0") is None


# scontrol show job ID
SCONTROL = {
    "COMPLETED": ("COMPLETED", "0:0", None, 0, "n[1-2]"),
    "FAILED": ("FAILED", "3:0", "NonZeroExitCode", 0, "n1"),
    "CANCELLED": ("CANCELLED", "0:15", None, 0, "n1"),
    "TIMEOUT": ("TIMEOUT", "0:15", "TimeLimit", 0, "n1"),
    "NODE_FAIL": ("NODE_FAIL", "0:0", "NodeDown", 0, "n2"),
    "RUNNING": ("RUNNING", "0:0", None, 0, "n1"),
    "PENDING": ("PENDING", "0:0", "Resources", 0, None),
    "REQUEUED_PENDING": ("PENDING", "0:0", "BeginTime", 1, None),
    "REQUEUED_COMPLETED": ("COMPLETED", "0:0", None, 1, "n1"),
}


@pytest.mark.parametrize("name", sorted(SCONTROL))
def test_scontrol(name: str) -> None:
    text, job = recorded(f"scontrol_{name}.txt")
    info = slurm.parse_scontrol(text, job)
    assert info is not None and info.source == "scontrol"
    state, exit_code, reason, restarts, nodes = SCONTROL[name]
    assert info.state == state and info.restarts == restarts and info.nodes == nodes
    assert info.reason == reason
    if name != "CANCELLED":  # recorded while COMPLETING or after; the exit code moves meanwhile
        assert info.exit_code == exit_code
    assert slurm.parse_scontrol(text, job + "0") is None


def test_scontrol_pairs_keep_odd_keys_and_values() -> None:
    text, _ = recorded("scontrol_COMPLETED.txt")
    pairs = slurm.parse_scontrol_pairs(text)
    assert pairs["AllocNode:Sid"].startswith(pairs["AllocNode:Sid"].split(":")[0])
    assert pairs["NtasksPerN:B:S:C"] == "2:0:*:*"
    assert pairs["CPUs/Task"] == "1"
    assert pairs["TRES"].startswith("cpu=4,node=2")  # '=' inside a value stays in the value
    assert pairs["Power"] == ""
    spaced = slurm.parse_scontrol_pairs("   Command=/runs/my run/job.sbatch\n   WorkDir=/a b\n")
    assert spaced == {"Command": "/runs/my run/job.sbatch", "WorkDir": "/a b"}


def test_sources_agree_on_final_states() -> None:
    for name in ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "REQUEUED_COMPLETED"):
        states = {slurm.parse_sacct(*recorded(f"sacct_{name}.txt")).state,  # type: ignore[union-attr]
                  slurm.parse_squeue(*recorded(f"squeue_{name}.txt")).state,  # type: ignore[union-attr]
                  slurm.parse_scontrol(*recorded(f"scontrol_{name}.txt")).state}  # type: ignore[union-attr]
        assert len(states) == 1, (name, states)


# sbatch


def test_sbatch_error_is_sbatchs_own_line() -> None:
    stderr = (FIXTURES / "sbatch_gres_too_many.stderr").read_text()
    assert MANIFEST["files"]["sbatch_gres_too_many.txt"]["returncode"] == 1
    assert slurm.error_line(stderr) == "Batch job submission failed: Requested node configuration is not available"
    several = "sbatch: error: Memory specification can not be satisfied\n" + stderr
    assert slurm.error_line(several) == slurm.error_line(stderr)
    assert slurm.error_line("", "exit code 1") == "exit code 1"
    assert slurm.error_line("something odd\n") == "something odd"


@pytest.mark.parametrize("stdout, job", [("12\n", "12"), ("12;devcluster\n", "12"),
                                         ("sbatch: warning: x\n345\n", "345")])
def test_sbatch_parsable(stdout: str, job: str) -> None:
    assert slurm.parse_sbatch(stdout) == job


@pytest.mark.parametrize("stdout", ["", "Submitted batch job 12\n", "error\n"])
def test_sbatch_parsable_refuses_non_ids(stdout: str) -> None:
    with pytest.raises(SubmitError, match="expected a job id"):
        slurm.parse_sbatch(stdout)


@pytest.mark.parametrize("text, seconds", [
    ("1-02:03:04\n", 93784), ("2-00:00:00", 172800), ("12:34:56", 45296), ("0:00:30", 30), ("59:59", 3599),
    ("1:05", 65), ("7", 7), ("UNLIMITED", None), ("NOT_SET", None), ("INVALID", None), ("", None), ("  \n", None),
    ("x-1:00", None), ("1:xx", None)])
def test_time_left(text: str, seconds: float | None) -> None:
    """squeue's %L as the exit hook reads it: a time limit near tells a timeout from a preemption."""
    assert slurm.parse_time_left(text) == seconds


def test_time_left_and_requeue_ask_slurm_through_one_door(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_slurm(monkeypatch, {"squeue": "1-00:00:10\n", "scontrol": ""})
    assert slurm.time_left("12") == 86410
    assert slurm.requeue("12") is None
    assert calls.argv == [["squeue", "-h", "-j", "12", "-o", "%L"], ["scontrol", "requeue", "12"]]
    fake_slurm(monkeypatch, {})  # every command refused: its last line is the complaint
    assert slurm.time_left("12") is None
    assert slurm.requeue("12") == "slurm_load_jobs error: Invalid job id specified"


# Which source wins (commands replaced by the recordings)


def fake_slurm(monkeypatch: pytest.MonkeyPatch, outputs: dict[str, str | Exception]) -> list[str]:
    """Slurm's commands replaced by recorded output; returns the commands run (their full argv: ``calls.argv``)."""
    calls = Calls()

    def run(argv: list[str], timeout: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv[0])
        calls.argv.append(argv)
        out = outputs.get(argv[0], SubmitError(f"{argv[0]} failed (exit 1): slurm_load_jobs error: Invalid job id "
                                                  "specified"))
        if isinstance(out, Exception):
            if check:
                raise out
            return subprocess.CompletedProcess(argv, 1, "", str(out).split(": ", 1)[-1])  # as proc.run returns it
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(slurm.proc, "run", run)
    return calls


class Calls(list[str]):
    def __init__(self) -> None:
        super().__init__()
        self.argv: list[list[str]] = []


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_query_final_sacct_state_needs_no_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_slurm(monkeypatch, {"sacct": text("sacct_TIMEOUT.txt")})
    info = slurm.query("1")
    assert info is not None and (info.state, info.source) == ("TIMEOUT", "sacct") and calls == ["sacct"]


def test_query_lagging_sacct_defers_to_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(monkeypatch, {"sacct": text("sacct_RUNNING_lag.txt"), "squeue": text("squeue_RUNNING.txt")})
    info = slurm.query("5")
    assert info is not None and (info.state, info.source) == ("RUNNING", "squeue")
    fake_slurm(monkeypatch, {"sacct": text("sacct_PENDING_lag.txt"), "squeue": text("squeue_PENDING.txt")})
    info = slurm.query("6")
    assert info is not None and (info.state, info.reason) == ("PENDING", "Resources")


def test_query_without_accounting_uses_squeue_then_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    no_acct = SubmitError("sacct failed (exit 1): sacct: error: Slurm accounting storage is disabled")
    fake_slurm(monkeypatch, {"sacct": no_acct, "squeue": text("squeue_FAILED.txt")})
    assert slurm.job_state("4") == "failed"
    calls = fake_slurm(monkeypatch, {"sacct": no_acct, "scontrol": text("scontrol_REQUEUED_PENDING.txt")})
    info = slurm.query("8")
    assert info is not None and (info.state, info.restarts, info.source) == ("PENDING", 1, "scontrol")
    assert calls == ["sacct", "squeue", "scontrol"]


def test_query_forgotten_job_is_none_and_sacct_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(monkeypatch, {"sacct": ""})
    assert slurm.query("99") is None and slurm.job_state("99") is None
    # controller forgot it but accounting has a (non-final) row: better than nothing
    fake_slurm(monkeypatch, {"sacct": text("sacct_duplicates_REQUEUED_PENDING.txt")})
    info = slurm.query("8")
    assert info is not None and info.state == "REQUEUED"


# Many jobs in one command: the recorded rows of several jobs, concatenated as one sacct or squeue prints them


def rows(*names: str) -> str:
    return "".join(text(n) for n in names)


MANY_SACCT = rows("sacct_TIMEOUT.txt", "sacct_NODE_FAIL.txt", "sacct_COMPLETED.txt", "sacct_FAILED.txt",
                  "sacct_RUNNING_lag.txt", "sacct_PENDING_lag.txt", "sacct_PENDING_held.txt",
                  "sacct_duplicates_REQUEUED_PENDING.txt")
MANY_SQUEUE = rows("squeue_TIMEOUT.txt", "squeue_NODE_FAIL.txt", "squeue_COMPLETED.txt", "squeue_FAILED.txt",
                   "squeue_RUNNING.txt", "squeue_PENDING.txt", "squeue_PENDING_held.txt", "squeue_REQUEUED_PENDING.txt")


def test_sacct_many_jobs_parse_as_each_alone() -> None:
    got = slurm.parse_sacct_many(MANY_SACCT)
    assert sorted(got) == ["1", "2", "3", "4", "5", "7", "8"]  # 6 was not in accounting yet (the _lag recording)
    for name in ("TIMEOUT", "NODE_FAIL", "COMPLETED", "FAILED", "RUNNING_lag", "PENDING_held",
                 "duplicates_REQUEUED_PENDING"):
        alone, job = recorded(f"sacct_{name}.txt")
        assert got[job] == slurm.parse_sacct(alone, job), name
    assert got["8"].restarts == 1


def test_sacct_many_keeps_each_jobs_attempts_in_order() -> None:
    """-D prints one row per attempt; another job's rows in between change nothing."""
    got = slurm.parse_sacct_many(rows("sacct_REQUEUED_PENDING.txt", "sacct_FAILED.txt", "sacct_REQUEUED_COMPLETED.txt"))
    assert (got["8"].state, got["8"].restarts) == ("COMPLETED", 1)
    assert got["4"].state == "FAILED"


def test_squeue_many_jobs_parse_as_each_alone() -> None:
    got = slurm.parse_squeue_many(MANY_SQUEUE)
    assert sorted(got) == [str(i) for i in range(1, 9)]
    for name in ("TIMEOUT", "NODE_FAIL", "COMPLETED", "FAILED", "RUNNING", "PENDING", "PENDING_held",
                 "REQUEUED_PENDING"):
        alone, job = recorded(f"squeue_{name}.txt")
        assert got[job] == slurm.parse_squeue(alone, job), name


def test_query_many_asks_each_command_once(monkeypatch: pytest.MonkeyPatch) -> None:
    live = rows("squeue_RUNNING.txt", "squeue_PENDING.txt", "squeue_PENDING_held.txt", "squeue_REQUEUED_PENDING.txt")
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": live})
    got = slurm.query_many(["1", "2", "3", "4", "5", "6", "7", "8", "99", "4", ""])
    assert calls == ["sacct", "squeue", "scontrol"]
    assert calls.argv[0][calls.argv[0].index("-j") + 1] == "1,2,3,4,5,6,7,8,99"
    assert calls.argv[1][calls.argv[1].index("-j") + 1] == "5,6,7,8,99"  # only those sacct did not see end
    assert calls.argv[2] == ["scontrol", "show", "job", "99"]  # only the one neither knew
    assert {j: (i.state, i.source) for j, i in got.items()} == {
        "1": ("TIMEOUT", "sacct"), "2": ("NODE_FAIL", "sacct"), "3": ("COMPLETED", "sacct"), "4": ("FAILED", "sacct"),
        "5": ("RUNNING", "squeue"), "6": ("PENDING", "squeue"), "7": ("PENDING", "squeue"),
        "8": ("PENDING", "squeue")}
    assert (got["6"].reason, got["7"].reason, got["8"].reason) == ("Resources", "JobHeldUser", "BeginTime")


def test_query_many_without_accounting_and_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs nobody knows: scontrol is the last resort, for a bounded number of them."""
    no_acct = SubmitError("sacct failed (exit 1): sacct: error: Slurm accounting storage is disabled")
    calls = fake_slurm(monkeypatch, {"sacct": no_acct, "squeue": ""})
    assert slurm.query_many(str(i) for i in range(100, 130)) == {}
    assert calls.count("sacct") == 1 and calls.count("squeue") == 1
    assert calls.count("scontrol") == slurm.MAX_SCONTROL
    # the controller forgot it but accounting has a (non-final) row: better than nothing
    fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": "", "scontrol": text("scontrol_PENDING.txt")})
    got = slurm.query_many(["6", "8"])
    assert (got["6"].state, got["6"].source) == ("PENDING", "scontrol")
    assert (got["8"].state, got["8"].source) == ("REQUEUED", "sacct")


ASKED = [  # what each command answers -> ask_many's answer (None: Slurm could not be asked at all)
    pytest.param({}, {}, id="no command knows the jobs: an answer (they are gone)"),
    pytest.param({"sacct": "", "squeue": SubmitError("squeue: no answer within 15 s"),
                  "scontrol": SubmitError("scontrol: no answer within 15 s")}, {}, id="accounting answered"),
    pytest.param({"sacct": SubmitError("sacct failed (exit 1): sacct: error: Slurm accounting storage is disabled"),
                  "squeue": SubmitError("squeue: no answer within 15 s"),
                  "scontrol": SubmitError("scontrol failed (exit 1): slurm_load_jobs error: Unable to contact slurm "
                                          "controller (connect failure)")}, None, id="nobody answered: cannot ask"),
    pytest.param({"sacct": SubmitError("sacct: command not found"), "squeue": SubmitError("squeue: command not found"),
                  "scontrol": SubmitError("scontrol: command not found")}, None, id="no Slurm commands: cannot ask"),
]


@pytest.mark.parametrize("outputs, answer", ASKED)
def test_ask_many_tells_cannot_ask_from_does_not_know(monkeypatch: pytest.MonkeyPatch,
                                                      outputs: dict[str, str | Exception], answer: Any) -> None:
    """cron and resume must not read "Slurm could not be asked" as "the job is gone" (a second trainer)."""
    fake_slurm(monkeypatch, outputs)
    assert slurm.ask_many(["41", "42"]) == answer
    assert slurm.query_many(["41", "42"]) == {}  # a view (status) shows what the run directory says


def test_query_many_splits_long_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "CHUNK", 3)
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    got = slurm.query_many(str(i) for i in range(1, 9))
    assert calls == ["sacct"] * 3 + ["squeue"] * 2  # 8 ids; then 5, 6, 7, 8 for the controller
    assert sorted(got) == [str(i) for i in range(1, 9)]
    calls = fake_slurm(monkeypatch, {})
    assert slurm.query_many([]) == {} and calls == []


# Slurm's words -> runner's states, and Slurm's state combined with the run directory's own records: the
# decision tables in tests/test_policy.py.


def test_row_reads_slurm_for_slurm_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    run.config.write_text("scheduler: slurm\n")
    run.manifest.write_text(json.dumps({"scheduler": "slurm", "config_hash": "x", "created": 0}))
    run.job_id_file.write_text("6\n")
    run.record("submitted", job_id="6")
    fake_slurm(monkeypatch, {"sacct": "", "squeue": text("squeue_PENDING.txt")})
    row = status.row(run)
    assert (row["state"], row["slurm_state"], row["reason"], row["job_id"]) == ("pending", "PENDING", "Resources", "6")
    assert "pending (Resources)" in status.table([row])
    run.record("start", job_id="6")
    fake_slurm(monkeypatch, {"sacct": text("sacct_RUNNING_lag.txt").replace("5|", "6|", 1),
                             "squeue": text("squeue_RUNNING.txt").replace("5|", "6|", 1)})
    assert status.row(run)["state"] == "running"
    run.record("cancelled", job_id="6")
    fake_slurm(monkeypatch, {})  # Slurm forgot it: the ledger's `cancelled` is the last word
    assert status.row(run)["state"] == "cancelled"
    run.finished.write_text("{}")
    # training finished while the job still runs its exit hook: completed, and Slurm's word is shown
    fake_slurm(monkeypatch, {"squeue": text("squeue_RUNNING.txt").replace("5|", "6|", 1)})
    row = status.row(run)
    assert (row["state"], row["slurm_state"]) == ("completed", "RUNNING")
    run.record("exit", job_id="6", exit_code=0)
    calls = fake_slurm(monkeypatch, {})
    assert status.row(run)["state"] == "completed" and calls == []  # finished and exited: no need to ask


CONFIG = ("scheduler: slurm\nslurm: {requeue: true, signal_lead_s: 120}\nresume: {max_restarts: 3, backoff_s: 0}\n"
          "alerts: {enabled: false}\n")


def make_run(root: Path, name: str, job: str | None, *events: str, scheduler: str = "slurm",
             finished: bool = False) -> RunDir:
    """A run directory as submit and the hooks leave it: config, manifest, job id, ledger."""
    run = RunDir(root / name)
    run.root.mkdir(parents=True)
    run.config.write_text(CONFIG.replace("slurm\n", f"{scheduler}\n", 1))
    run.manifest.write_text(json.dumps({"scheduler": scheduler, "config_hash": "x", "created": 0}))
    if job:
        run.job_id_file.write_text(job + "\n")
    run.record("submitted", job_id=job)
    for event in events:
        fields: dict[str, Any] = {"job_id": job}
        if event == "exit":
            fields.update(exit_code=1, outcome="failed")
            run.exit_status.write_text(json.dumps({"exit_code": 1, "job_id": job, "event": "failed"}))
        run.record(event, **fields)
    if finished:
        run.finished.write_text("{}")
    return run


def test_status_asks_slurm_once_for_all_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path, "a-timeout", "1", "start", "exit")
    make_run(tmp_path, "b-running", "5", "start")
    make_run(tmp_path, "c-pending", "6")
    make_run(tmp_path, "d-done", "3", "start", "finished", "exit", finished=True)  # nothing Slurm can change
    local = make_run(tmp_path, "e-local", None, "start", scheduler="local")
    broken = make_run(tmp_path, "f-broken", "4", "start")
    broken.manifest.write_text("[]")
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    with open(local.owner_lock, "a") as lock:  # a live local run holds its owner lock (else it is a dead one)
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = status.collect(None, tmp_path)
    assert calls == ["sacct", "squeue"]
    assert calls.argv[0][calls.argv[0].index("-j") + 1] == "1,5,6"
    assert [(r["run"], r["state"]) for r in rows] == [
        ("a-timeout", "timeout"), ("b-running", "running"), ("c-pending", "pending"), ("d-done", "completed"),
        ("e-local", "running"), ("f-broken", "unreadable")]
    assert "manifest.json" in rows[-1]["error"]
    table = status.table(rows)
    assert len(table.splitlines()) == 1 + len(rows) and "error: RunnerError" in table
    assert "pending (Resources)" in table


def test_cron_asks_slurm_once_and_a_broken_run_stops_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from runner.host import cron

    make_run(tmp_path, "a-done", "3", "start", "finished", "exit", finished=True)
    make_run(tmp_path, "b-cancelled", "5", "start", "cancelled")
    make_run(tmp_path, "c-failed", "4", "start", "exit")
    make_run(tmp_path, "d-pending", "6")
    make_run(tmp_path, "e-local", None, scheduler="local")
    make_run(tmp_path, "f-broken", "2", "start").config.write_text("slurm: [")  # NODE_FAIL, no exit recorded
    resubmitted: list[str] = []
    monkeypatch.setattr(scheduler.SLURM, "resubmit",
                        lambda run, cfg, reason: resubmitted.append(f"{run.name}: {reason}"))
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    assert cron.run_once([tmp_path]) == 0
    # one sacct for c, d, f; squeue for d (not in accounting yet); c's resubmission is confirmed with a fresh sacct
    assert calls == ["sacct", "squeue", "sacct"]
    assert calls.argv[0][calls.argv[0].index("-j") + 1] == "4,6,2"
    assert resubmitted == ["c-failed: job 4 ended FAILED (exit 1)"]
    assert capsys.readouterr().out == "c-failed: resubmit: job 4 ended FAILED (exit 1)\n"
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelname == "ERROR"] == ["f-broken"]


# The interface detection's parsers (outputs recorded inside the dev cluster's node namespaces)

ROUTE_REMOTE = "10.77.0.2 dev eth0 src 10.77.0.1 uid 0 \\    cache \n"
ROUTE_LOCAL = "local 10.77.0.1 dev lo src 10.77.0.1 uid 0 \\    cache <local> \n"
ROUTE_VIA = "8.8.8.8 via 192.0.2.1 dev eth0 src 192.0.2.2 uid 0 \\    cache \n"
ADDR_SHOW = "2: eth0    inet 10.77.0.1/24 scope global eth0\\       valid_lft forever preferred_lft forever\n"


def test_route_and_addr_parsers() -> None:
    assert ifname.parse_route_get(ROUTE_REMOTE) == ("eth0", "10.77.0.1", False)
    assert ifname.parse_route_get(ROUTE_LOCAL) == ("lo", "10.77.0.1", True)
    assert ifname.parse_route_get(ROUTE_VIA) == ("eth0", "192.0.2.2", False)
    assert ifname.parse_addr_show(ADDR_SHOW) == "eth0"
    assert ifname.parse_addr_show("7: ib0@if12    inet 10.0.0.5/16 scope global ib0\n") == "ib0"
    assert ifname.parse_addr_show("") is None


def test_detect_uses_the_owner_of_a_local_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the master node the route to MASTER_ADDR is `lo`; gloo must get the NIC the peers reach."""
    answers = {("route", "get", "10.77.0.1"): ROUTE_LOCAL, ("addr", "show", "to", "10.77.0.1/32"): ADDR_SHOW,
               ("route", "get", "10.77.0.2"): ROUTE_REMOTE}
    monkeypatch.setattr(ifname, "_ip", lambda *a: answers.get(a))
    assert ifname.detect_ifname("10.77.0.1") == "eth0"
    assert ifname.detect_ifname("10.77.0.2") == "eth0"
    # What the launcher does with the detected name (user patterns kept, the config wins): test_preflight.py


def test_sbatch_gets_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job submitted from inside an allocation or a scrontab job must not inherit that job's variables."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SBATCH_PARTITION", "other")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    env = proc.clean_env()
    assert "SLURM_JOB_ID" not in env and "SBATCH_PARTITION" not in env
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["PATH"] == os.environ["PATH"]


def test_a_node_whose_slurmd_refuses_a_connection_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step reaper's word on a silent node (slurm.slurmd_answers), against real sockets: scontrol's answer (a
    node line as Slurm 22.05 prints it, and its config) names where the node's slurmd listens."""
    import socket

    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    free = closed.getsockname()[1]
    closed.close()
    said: dict[str, str] = {}

    def scontrol(argv: list[str], asked: object = None) -> str | None:
        return said.get(argv[2])

    monkeypatch.setattr(slurm, "_try", scontrol)
    try:
        for node_line, config, answers in [
            (f"NodeName=n2 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=n2 Port={listening.getsockname()[1]}", "",
             True),
            ("NodeName=n2 NodeAddr=127.0.0.1 NodeHostName=n2", f"SlurmdPort              = {free}\n", False),
            ("NodeName=n2 NodeHostName=n2", "SlurmdPort = 6818\n", None),  # no address: cannot say
            (None, None, None),  # Slurm does not answer
        ]:
            said = {"node": node_line, "config": config} if node_line is not None else {}
            assert slurm.slurmd_answers("n2", timeout=2.0) is answers, node_line
    finally:
        listening.close()
