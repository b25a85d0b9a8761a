"""Parsers of Slurm's output, against output recorded from a real Slurm 22.05 (tests/fixtures/slurm/).

The recordings come from `python -m tests.fixtures.slurm.record` on the dev cluster; manifest.json names
the command and the job id of each file. The ``_lag`` files were taken right after the controller changed
the job's state, before slurmdbd caught up: they are why runner asks the controller when sacct is not final.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from runner import proc
from runner.errors import SubmitError
from runner.host import slurm, status
from runner.job import ifname as rendezvous
from runner.rundir import EXIT_REQUEUE, RunDir

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


# Which source wins (commands replaced by the recordings)


def fake_slurm(monkeypatch: pytest.MonkeyPatch, outputs: dict[str, str | Exception]) -> list[str]:
    calls: list[str] = []

    def run(argv: list[str], timeout: float = 60, env: Any = None, error: type[Exception] = SubmitError) -> str:
        calls.append(argv[0])
        out = outputs.get(argv[0], error(f"{argv[0]} failed (exit 1): slurm_load_jobs error: Invalid job id"))
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(slurm.proc, "run", run)
    return calls


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


@pytest.mark.parametrize("raw, want", [("CANCELLED by 0", "cancelled"), ("COMPLETING", "running"),
                                       ("RUNNING+", "running"), ("OUT_OF_MEMORY", "failed"),
                                       ("DEADLINE", "timeout"), ("", None), ("NEW_STATE", None)])
def test_normalize(raw: str, want: str | None) -> None:
    assert slurm.normalize(raw) == want


# Slurm's state combined with the run directory's own records


def info_from(name: str) -> slurm.JobInfo:
    src = name.split("_", 1)[0]
    parse = {"sacct": slurm.parse_sacct, "squeue": slurm.parse_squeue, "scontrol": slurm.parse_scontrol}[src]
    got = parse(*recorded(name))
    assert got is not None
    return got


def test_combine() -> None:
    # live states come from Slurm, whatever the run directory guessed
    assert status.combine("pending", info_from("squeue_RUNNING.txt")) == "running"
    assert status.combine("running", info_from("squeue_REQUEUED_PENDING.txt")) == "pending"
    # final states: Slurm's, unless the run directory knows better
    assert status.combine("failed", info_from("sacct_TIMEOUT.txt")) == "timeout"
    assert status.combine("failed", info_from("sacct_CANCELLED.txt")) == "cancelled"
    assert status.combine("failed", info_from("sacct_NODE_FAIL.txt")) == "failed"
    assert status.combine("completed", info_from("sacct_FAILED.txt")) == "completed"  # `finished` marker wins
    assert status.combine("failed", info_from("sacct_COMPLETED.txt")) == "failed"  # exit 0 without `finished`
    assert status.combine("preempted", info_from("sacct_FAILED.txt")) == "preempted"  # exit 75: requeue me
    requeue = slurm.JobInfo("9", "FAILED", "sacct", exit_code=f"{EXIT_REQUEUE}:0")
    assert status.combine("running", requeue) == "preempted"
    # Slurm forgot the job: the run directory is all there is
    assert status.combine("failed", None) == "failed"
    assert status.combine("failed", slurm.JobInfo("9", "WEIRD", "squeue")) == "failed"


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


# The interface detection's parsers (outputs recorded inside the dev cluster's node namespaces)

ROUTE_REMOTE = "10.77.0.2 dev eth0 src 10.77.0.1 uid 0 \\    cache \n"
ROUTE_LOCAL = "local 10.77.0.1 dev lo src 10.77.0.1 uid 0 \\    cache <local> \n"
ROUTE_VIA = "8.8.8.8 via 192.0.2.1 dev eth0 src 192.0.2.2 uid 0 \\    cache \n"
ADDR_SHOW = "2: eth0    inet 10.77.0.1/24 scope global eth0\\       valid_lft forever preferred_lft forever\n"


def test_route_and_addr_parsers() -> None:
    assert rendezvous.parse_route_get(ROUTE_REMOTE) == ("eth0", "10.77.0.1", False)
    assert rendezvous.parse_route_get(ROUTE_LOCAL) == ("lo", "10.77.0.1", True)
    assert rendezvous.parse_route_get(ROUTE_VIA) == ("eth0", "192.0.2.2", False)
    assert rendezvous.parse_addr_show(ADDR_SHOW) == "eth0"
    assert rendezvous.parse_addr_show("7: ib0@if12    inet 10.0.0.5/16 scope global ib0\n") == "ib0"
    assert rendezvous.parse_addr_show("") is None


def test_detect_uses_the_owner_of_a_local_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the master node the route to MASTER_ADDR is `lo`; gloo must get the NIC the peers reach."""
    answers = {("route", "get", "10.77.0.1"): ROUTE_LOCAL, ("addr", "show", "to", "10.77.0.1/32"): ADDR_SHOW,
               ("route", "get", "10.77.0.2"): ROUTE_REMOTE}
    monkeypatch.setattr(rendezvous, "_ip", lambda *a: answers.get(a))
    assert rendezvous.detect_ifname("10.77.0.1") == "eth0"
    assert rendezvous.detect_ifname("10.77.0.2") == "eth0"
    env = {"MASTER_ADDR": "10.77.0.2", "NCCL_SOCKET_IFNAME": "^docker,lo"}
    assert rendezvous.setup_env(env) == "eth0"
    assert env == {"MASTER_ADDR": "10.77.0.2", "NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0"}
    env = {"MASTER_ADDR": "10.77.0.2", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert rendezvous.setup_env(env) is None and env["GLOO_SOCKET_IFNAME"] == "ib0"  # config wins
    assert rendezvous.setup_env({}) is None


def test_detect_on_this_machine() -> None:
    assert rendezvous.detect_ifname("127.0.0.1") == "lo"
    assert rendezvous.detect_ifname("no-such-host.invalid") is None


def test_sbatch_gets_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job submitted from inside an allocation or a scrontab job must not inherit that job's variables."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SBATCH_PARTITION", "other")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    env = proc.clean_env()
    assert "SLURM_JOB_ID" not in env and "SBATCH_PARTITION" not in env
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["PATH"] == os.environ["PATH"]
