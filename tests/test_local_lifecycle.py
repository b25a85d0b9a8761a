"""A local run keeps a Slurm run's promises (issues 30 and 31), with real processes: one trainer per run directory (an
owner lock held while any process of the run lives; resume refused, a dead run's lock taken over), cancel stops the
processes, a hang ends the attempt (exit 79) and resumes, Ctrl-C is `interrupted` and a second one stops at once, a
killed run is not `running` forever, and the first rank to fail is the cause on the console, in status and the alert.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.errors import SubmitError
from runner.host import local
from runner.rundir import RunDir, read_json
from tests.waiting import alive, ended, until
from tests.webhook_server import WebhookServer

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
SLOW = "model.step_time_s=0.05"  # training lasts long enough to act on it; no number depends on it
pytestmark = pytest.mark.local


def env(webhook: WebhookServer | None = None) -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1"}
    out.pop("RUNNER_WEBHOOK_URL", None)
    if webhook is not None:
        out["RUNNER_WEBHOOK_URL"] = webhook.url
    return out


def runner(*args: str, timeout: float = 240, webhook: WebhookServer | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True,
                          env=env(webhook), timeout=timeout)


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runner", *args], env=env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def submit(root: Path, *overrides: str) -> tuple[subprocess.Popen[str], Path]:
    proc = start("submit", str(QUICKSTART), f"run_root={root}", SLOW, *overrides)

    def appeared() -> list[Path]:
        runs = list(root.glob("quickstart-*"))
        assert runs or proc.poll() is None, "no run directory appeared: `runner submit` ended"
        return runs
    return proc, until(f"a run directory in {root}", appeared, 120)[0]


def wait_for(path: Path, proc: subprocess.Popen[str] | None = None, timeout: float = 180) -> None:
    def appeared() -> bool:
        if path.exists():
            return True
        assert proc is None or proc.poll() is None, f"the run ended before {path} appeared: {proc.communicate()[0]}"
        return False
    until(f"{path} to appear", appeared, timeout)


def owner(run: Path, attempt: int) -> dict[str, Any]:
    """The run's owner.json once it names this attempt's ranks."""
    def naming() -> dict[str, Any] | None:
        try:
            found = json.loads((run / "owner.json").read_text())
        except (OSError, ValueError):
            return None
        return dict(found) if found.get("attempt") == attempt else None
    return until(f"owner.json to name attempt {attempt}", naming, 60)


def status(run: Path) -> dict[str, Any]:
    out = runner("status", str(run), "--json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout)[0])


def test_the_owner_lock_refuses_a_second_starter_and_is_taken_over_once_its_holder_died(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    hold = ("import pathlib, sys; from runner.host import local; from runner.rundir import RunDir; "
            "local.acquire(RunDir(pathlib.Path(sys.argv[1]))); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run.root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert local.held(run)
    with pytest.raises(SubmitError, match="one trainer per run directory"):
        local.acquire(run)
    holder.kill()  # dies holding it: the kernel drops the lock, owner.json stays
    holder.wait()
    assert not local.held(run)
    owner = local.acquire(run)
    assert owner.took_over is not None and owner.took_over["pid"] == holder.pid
    owner.close()
    assert "ended" in json.loads(run.local_owner.read_text())


def test_resume_is_refused_while_any_process_of_the_run_lives_and_cancel_stops_them(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=100000")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    ranks = owner(run, 1)["ranks"]
    refused = runner("resume", str(run))
    assert refused.returncode != 0 and "one trainer per run directory" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert RunDir(run).attempts() == [1]  # nothing was started: no second attempt's logs
    proc.kill()  # the driver dies; its ranks train on and hold the lock
    proc.communicate(timeout=30)
    assert all(alive(p) for p in ranks)
    again = runner("resume", str(run))
    assert again.returncode != 0 and "one trainer per run directory" in again.stderr
    assert status(run)["state"] == "running"
    t0 = time.monotonic()
    out = runner("cancel", str(run))
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "stopped" in out.stdout, out.stdout
    assert not any(alive(p) for p in ranks)  # gone when cancel returned
    print(f"cancel -> processes gone: {took:.2f} s ({out.stdout.strip().splitlines()[-1]})")
    assert status(run)["state"] == "cancelled"


def test_cancel_of_a_local_run_stops_its_driver_and_ranks(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=100000")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    ranks = owner(run, 1)["ranks"]
    out = runner("cancel", str(run))
    assert out.returncode == 0 and "stopped" in out.stdout, out.stdout + out.stderr
    assert proc.wait(timeout=5) is not None  # the driver is gone too
    assert not any(alive(p) for p in ranks)
    n = len(list((run / "checkpoints").glob("step-*")))
    row = status(run)
    assert row["state"] == "cancelled" and row["last_outcome"] == "cancelled"
    assert len(list((run / "checkpoints").glob("step-*"))) == n  # nothing trains on


def test_a_killed_run_is_failed_not_running_and_its_stale_lock_is_taken_over(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=120")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    who = owner(run, 1)
    proc.kill()
    proc.communicate(timeout=30)
    for pid in who["ranks"]:
        os.killpg(pid, signal.SIGKILL)
    ended(who["ranks"])
    assert status(run)["state"] == "failed"
    follow = runner("logs", str(run), "--follow", timeout=60)  # returns: the run is over
    assert follow.returncode == 0, follow.stderr
    out = runner("resume", str(run))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "taking over from a local run that died" in out.stderr
    assert (run / "finished").exists()
    assert status(run)["state"] == "completed"


def test_a_hang_ends_the_local_run_with_79_and_resume_finishes_it(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=150", "watchdog.floor_s=5")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    ranks = owner(run, 1)["ranks"]
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    out, _ = proc.communicate(timeout=240)
    took = time.monotonic() - t0
    assert proc.returncode == 79, out
    assert not any(alive(p) for p in ranks)
    print(f"SIGSTOP of rank 1 -> runner submit exits 79: {took:.1f} s")
    row = status(run)
    assert row["state"] == "failed" and row["last_outcome"] == "hang", row
    assert "rank 1" in row["last_cause"], row
    resumed = runner("resume", str(run))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert status(run)["state"] == "completed"


def test_ctrl_c_is_interrupted_and_a_second_one_stops_at_once(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=100000")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    owner(run, 1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert "Ctrl-C again" in out
    row = status(run)
    assert row["state"] == "interrupted" and row["last_outcome"] == "interrupted", row
    assert row["restarts"] == 0
    again = start("resume", str(run))
    ranks = owner(run, 2)["ranks"]
    beat = run / "heartbeats" / "rank-00001.json"

    def beating() -> bool:
        if (read_json(beat) or {}).get("attempt") == 2:
            return True
        assert again.poll() is None, again.communicate()[0]
        return False
    until("rank 1's heartbeat of attempt 2", beating, 180)
    os.kill(ranks[1], signal.SIGSTOP)  # a rank that can no longer checkpoint: one Ctrl-C would wait for it
    again.send_signal(signal.SIGINT)
    assert again.stdout is not None
    while "Ctrl-C again" not in (line := again.stdout.readline()):  # two signals sent at once would be one
        assert line, "the run ended before it acknowledged the first Ctrl-C"
    again.send_signal(signal.SIGINT)
    out, _ = again.communicate(timeout=60)
    assert again.returncode != 0, out
    assert not any(alive(p) for p in ranks)
    assert status(run)["state"] == "interrupted"


def test_the_first_failing_rank_is_the_cause_on_the_console_in_status_and_the_alert(
        tmp_path: Path, webhook: WebhookServer) -> None:
    out = runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=40",
                 "model.faults.raise_at_step=5", "model.faults.rank=1", "alerts.enabled=true", "alerts.kind=json",
                 webhook=webhook)
    assert out.returncode == 1, out.stdout + out.stderr
    [run] = tmp_path.glob("quickstart-*")
    assert "rank 1 on " in out.stdout and "RuntimeError: injected fault at step 5" in out.stdout, out.stdout
    assert "last lines of rank 1" in out.stdout
    row = status(run)
    assert row["state"] == "failed" and row["last_outcome"] == "failed"
    assert row["last_cause"].startswith("rank 1 on ") and "RuntimeError" in row["last_cause"], row
    [body] = webhook.wait_for(1, timeout=30)
    assert body["event"] == "failed" and body["cause"] == row["last_cause"], body
    assert "runner resume" in body["next_step"] and "cron" not in body["next_step"].replace("runner cron resubmits "
                                                                                           "Slurm runs only", "")


def test_a_rank_that_dies_as_a_resume_starts_ends_the_attempt_with_its_cause(tmp_path: Path) -> None:
    proc, run = submit(tmp_path, "trainer.max_steps=100000", "network.pg_timeout_s=300")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", proc)
    owner(run, 1)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    again = start("resume", str(run))
    ranks = owner(run, 2)["ranks"]
    os.killpg(ranks[0], signal.SIGKILL)  # rank 1 would wait for its verdict (or a collective) for pg_timeout_s
    out, _ = again.communicate(timeout=150)  # well under the 300 s a peer would wait without the driver
    assert again.returncode == 128 + signal.SIGKILL, out
    assert "rank 0 on " in out and "killed by SIGKILL" in out, out
    assert not any(alive(p) for p in ranks)
    row = status(run)
    assert row["state"] == "failed" and row["last_cause"].startswith("rank 0 on ") and "SIGKILL" in row["last_cause"]


SLEEPER = """import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.parametrize("command", [
    "bash -c 'exec python sleeper.py PIDFILE'",  # the program as the rank's child process
    "bash -c 'python sleeper.py PIDFILE & wait'",  # a shell that forks a grandchild
])
def test_no_process_of_a_program_outlives_its_rank_or_lets_a_second_trainer_in(tmp_path: Path, command: str) -> None:
    """Issue 39's two trainers: the rank launcher is SIGKILLed while its program (a child, or a shell's grandchild)
    trains. The program dies with its rank; and with the driver killed too, the program holds the run's lock:
    `runner resume` is refused while it lives, and taken once it is gone."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pidfile = tmp_path / "program.pid"
    conf = tmp_path / "prog.yaml"
    conf.write_text(json.dumps({
        "num_nodes": 1, "num_device": 1, "command": command.replace("PIDFILE", str(pidfile)),
        "runner": {"name": "prog", "scheduler": "local", "run_root": str(tmp_path / "runs"),
                   "container": {"runtime": "none"}, "alerts": {"enabled": False}}}))

    def started() -> tuple[subprocess.Popen[str], Path, int, int]:
        pidfile.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", str(conf)], env=env(), text=True,
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for(pidfile, proc)
        until(f"the program's pid in {pidfile}", pidfile.read_text, 60)
        [run] = (tmp_path / "runs").iterdir()
        return proc, run, owner(run, 1)["ranks"][0], int(pidfile.read_text())

    proc, run, launcher, program = started()
    os.kill(launcher, signal.SIGKILL)  # the rank dies; the driver sees it
    proc.communicate(timeout=60)
    until("the program to end with its rank (it must not outlive it)", lambda: not alive(program), 10)

    shutil.rmtree(tmp_path / "runs")
    proc, run, launcher, program = started()
    proc.kill()  # the driver first, then the rank: nobody is left to end the program
    proc.communicate(timeout=30)
    os.kill(launcher, signal.SIGKILL)
    ended([launcher])
    assert alive(program)
    refused = runner("resume", str(run))
    assert refused.returncode != 0 and "one trainer per run directory" in refused.stderr, refused.stderr
    assert RunDir(run).attempts() == [1]
    os.kill(program, signal.SIGKILL)
    ended([program])
    pidfile.unlink()
    again = start("resume", str(run))
    wait_for(pidfile, again)  # taken over: the program runs again, as the run's one trainer
    again.kill()
    again.communicate(timeout=30)
    for pid in [*owner(run, 2)["ranks"], int(pidfile.read_text())]:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def test_a_second_cancel_waits_for_the_first_and_the_ranks_still_checkpoint(tmp_path: Path) -> None:
    """Issue 39: two `runner cancel`s at once. The second does not escalate (a second SIGTERM is the driver's "stop at
    once"): it waits for the first; the ranks checkpoint at the step they agree on, as with one cancel. Steps of 2 s
    keep the stop under way while the later of the two starts."""
    proc, run = submit(tmp_path, "trainer.max_steps=100000", "model.step_time_s=2", "checkpoint.every_n_steps=2")
    wait_for(run / "checkpoints" / "step-0000002" / "COMPLETE", proc)
    both = [start("cancel", str(run)), start("cancel", str(run))]
    outs = [c.communicate(timeout=120)[0] for c in both]
    assert [c.returncode for c in both] == [0, 0], outs
    stopper = [out for out in outs if out.startswith("cancelling ")]
    assert len(stopper) == 1, outs  # only the cancel that stops the processes says it is cancelling
    assert "s after SIGTERM" in stopper[0] and "killed" not in stopper[0], outs
    assert sum("stopped by the cancel already under way" in out for out in outs) == 1, outs
    proc.communicate(timeout=30)
    log = (run / "logs" / "attempt-1" / "rank-00000.log").read_text()
    assert "stopped on signal at step" in log, log[-2000:]
    step = int(log.split("stopped on signal at step ")[1].split(";")[0])
    assert (run / "checkpoints" / f"step-{step:07d}" / "COMPLETE").exists()  # the stop's own checkpoint
    assert status(run)["state"] == "cancelled"
