"""The second hostile round (issue 30), the tests that start processes (the local tier): the CLI, hooks, cron, a real
run (the rest: tests/test_hostile_round2.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner import cli
from runner.errors import InputError
from runner.host import status, submit
from tests.test_hostile_round2 import QUICKSTART, REPO, fake_run

pytestmark = pytest.mark.local


def runner(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def one_error(out: subprocess.CompletedProcess[str], *words: str) -> str:
    """The command failed with one line, exit 2, no traceback, and the line says ``words``."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runner: error: "), out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_an_ambiguous_prefix_is_an_error_listing_the_candidates(tmp_path: Path) -> None:
    fake_run(tmp_path, "quickstart-big-20261124-235959")
    fake_run(tmp_path, "quickstart-20261124-100000")
    fake_run(tmp_path, "quickstart-20261125-100000")
    with pytest.raises(InputError) as err:
        status.find_run("quick", tmp_path)
    assert "quickstart-20261125-100000" in str(err.value) and "quickstart-big-20261124-235959" in str(err.value)
    assert "quickstart-20261124-100000" not in str(err.value)  # one line a name: its newest run
    out = runner("status", "quick", "--root", str(tmp_path))
    one_error(out, "found runs of 2 names", "hint:")


@pytest.mark.parametrize("name", ["**", "[", "a/../b", "*", "?"])
def test_glob_characters_in_a_run_name_are_a_one_line_error(tmp_path: Path, name: str) -> None:
    (tmp_path / "runs").mkdir()
    fake_run(tmp_path / "runs", "x-20261124-100000")
    one_error(runner("logs", name, cwd=tmp_path), "found no run directory")


def test_an_absolute_path_that_is_not_a_run_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    fake_run(tmp_path / "runs", "x-20261124-100000")
    for cmd in ("status", "logs", "resume", "cancel"):
        one_error(runner(cmd, str(tmp_path / "elsewhere"), cwd=tmp_path), "found no run directory")


def test_three_submits_of_one_config_in_one_second_all_get_their_own_run_directory(tmp_path: Path) -> None:
    overrides = [f"run_root={tmp_path / 'runs'}"]
    plans = [submit.plan(QUICKSTART, overrides) for _ in range(3)]  # planned in the same second: one name
    written = [submit.write(p) for p in plans]
    roots = {p.run.root for p in written}
    assert len(roots) == 3, roots
    for p in written:  # each directory holds its own plan: its script names itself
        assert str(p.run.root) in p.run.script.read_text()
        assert (p.run.root / "config.yaml").is_file()
    newest = max(roots, key=lambda r: status._run_name(r.name)[1])  # (stamp, N): a second may have passed
    assert status.find_run("quickstart", tmp_path / "runs").root == newest


def test_status_lists_the_runs_beside_an_entry_it_cannot_stat(tmp_path: Path) -> None:
    fake_run(tmp_path, "good-20261124-100000")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # ELOOP on every stat
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.yaml")  # a FIFO is no config: never opened
    out = runner("status", "--json", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert [r["run"] for r in json.loads(out.stdout)] == ["good-20261124-100000"]


def test_a_host_side_hook_that_cannot_start_is_said_and_recorded(tmp_path: Path) -> None:
    """The batch script's hook function with a Python that cannot run: the script goes on, says so on stderr and
    leaves a ledger line that runner cron alerts (no `|| true` hiding it)."""
    from runner import spec
    from runner.host import render

    path = tmp_path / "conf.yaml"
    path.write_text(QUICKSTART.read_text())
    script = render.sbatch(spec.load(path, ["scheduler=slurm"]), tmp_path, "none")
    start = script.index("hook() {")
    hook = script[start:script.index("\n}\n", start) + 3]
    out = subprocess.run(["bash", "-c", f'RUN_DIR={tmp_path}; RUNNER_PY=/nonexistent/python\n{hook}\n'
                          'SLURM_JOB_ID=77 hook exit --rc 1; echo "went on $?"'],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "went on 0\n"
    assert "the host-side 'exit' hook failed (exit 127" in out.stderr
    (line,) = (tmp_path / "ledger.jsonl").read_text().splitlines()
    event = json.loads(line)
    assert event["event"] == "hook_failed" and event["hook"] == "exit" and event["exit_code"] == 127
    from runner.rundir import RunDir

    assert RunDir(tmp_path).events()[0]["event"] == "hook_failed"
    # A job array's task (a Slurm sweep's point) records the id its hooks would have: runner.slurmstates.job_id.
    from runner import slurmstates

    task = {"SLURM_JOB_ID": "81", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "4"}
    (tmp_path / "ledger.jsonl").unlink()
    subprocess.run(["bash", "-c", f"RUN_DIR={tmp_path}; RUNNER_PY=/nonexistent/python\n{hook}\nhook exit --rc 1"],
                   capture_output=True, text=True, timeout=60, env={**os.environ, **task}, check=True)
    assert RunDir(tmp_path).events()[0]["job_id"] == slurmstates.job_id(task) == "77_4"


def test_a_fifo_as_the_config_or_the_url_file_is_refused_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "conf.yaml"
    os.mkfifo(fifo)
    for cmd in (["validate"], ["submit", "--dry-run"]):
        one_error(runner(*cmd, str(fifo)), "found a FIFO")  # a hang would end in the subprocess timeout
    url = tmp_path / "url"
    os.mkfifo(url, 0o600)
    out = runner("submit", "--dry-run", str(QUICKSTART), f"alerts.url_file={url}", f"run_root={tmp_path}/runs",
                 env={"RUNNER_WEBHOOK_URL": ""})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    from runner import alerts

    with pytest.raises(alerts.AlertConfigError, match="no regular file"):
        alerts.resolve_url({"enabled": True, "url_env": "RUNNER_TEST_NO_SUCH_VAR", "url_file": str(url)})


def failed_slurm_runs(root: Path, n: int) -> list[Path]:
    """``n`` Slurm runs as submit and the exit hook leave a failed job: each resubmittable by cron."""
    from runner.rundir import RunDir

    out = []
    for i in range(n):
        p = submit.plan(QUICKSTART, [f"run_root={root}", "scheduler=slurm", "container.runtime=none", f"name=r{i:03d}",
                                     "alerts.timeout_s=1", "alerts.retries=0", "resume.backoff_s=0"])
        p = submit.write(p)
        run, job = RunDir(p.run.root), str(100 + i)
        run.job_id_file.write_text(job + "\n")
        for event in ("submitted", "start"):
            run.record(event, job_id=job)
        run.record("exit", job_id=job, exit_code=1, outcome="failed")
        run.exit_status.write_text(json.dumps({"exit_code": 1, "job_id": job, "event": "failed"}))
        out.append(run.root)
    return out


def recorded_slurm(monkeypatch: pytest.MonkeyPatch, failed_jobs: int) -> None:
    """Slurm's commands answered with recorded output (the row format of tests/fixtures/slurm/sacct_FAILED.txt):
    jobs 100... ended FAILED; sbatch hands out 1000, 1001, ..."""
    from runner import proc

    sacct = "".join(f"{100 + i}|FAILED|1:0|n1|2026-11-22T13:12:50|2026-11-22T13:12:50|00:00:00\n"
                    for i in range(failed_jobs))
    jobs = iter(range(1000, 2000))

    def slurm(argv: list[str], timeout: float = 60, check: bool = True, **kw: object) -> \
            subprocess.CompletedProcess[str]:
        out = {"sacct": sacct, "sbatch": f"{next(jobs)}\n"}.get(argv[0], "")
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(proc, "run", slurm)


def test_cron_decides_every_run_before_it_sends_and_sends_without_the_lock_within_one_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's answers are recorded sacct/sbatch output (tests/fixtures/slurm); the webhook is a real socket that
    accepts and never answers. Every run is resubmitted before the first connection; while the sender waits on the
    webhook, the root's lock is free; one dead webhook is tried once in a pass, not once per run; nothing is lost."""
    from runner.host import cron
    from runner.rundir import RunDir, locked
    from tests.webhook_server import BlackHole

    root = tmp_path / "runs"
    runs = failed_slurm_runs(root, 6)
    recorded_slurm(monkeypatch, len(runs))
    lock_free: list[bool] = []

    def check_lock() -> None:
        with locked(root / ".runner-cron.lock", blocking=False) as held:
            lock_free.append(held)

    hole = BlackHole(on_accept=check_lock)
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", hole.url)
    try:
        assert cron.run_once([root]) == 0
    finally:
        hole.close()
    resubmitted = [e["time"] for r in runs for e in RunDir(r).events() if e["event"] == "resubmitted"]
    assert len(resubmitted) == len(runs)
    assert len(hole.accepted) == 1 and lock_free == [True]
    assert hole.accepted[0] >= max(resubmitted) - 0.01  # ledger times are rounded to ms
    for r in runs:  # nothing lost: each run's alert waits in its queue for the next pass
        assert len(list((r / "alerts" / "queue").glob("*-resubmitted.json"))) == 1


def test_cron_alerts_a_hook_that_could_not_run_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   webhook: Any) -> None:
    from runner.host import cron
    from runner.rundir import RunDir

    root = tmp_path / "runs"
    (run,) = failed_slurm_runs(root, 1)
    with open(run / "ledger.jsonl", "a") as f:  # as the batch script's hook() writes it
        f.write('{"event": "hook_failed", "exit_code": 127, "hook": "exit", "job_id": "100", "time": 1}\n')
    recorded_slurm(monkeypatch, 1)
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    cron.run_once([root])
    cron.run_once([root])  # said once
    texts = [json.dumps(r.json) for r in webhook.requests]
    assert sum("hook could not run (exit 127)" in t for t in texts) == 1, texts
    assert [e["event"] for e in RunDir(run).events()].count("hook_failure_alerted") == 1


SECRET_URL = "https://hooks.example.com/services/T0ABCDEF/B0ABCDEF/s3cr3tT0kenValue9"


def leaked(root: Path, url: str = SECRET_URL, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    from tests.test_secrets import found_in

    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in skip:
            if found := found_in(p.read_text(errors="replace"), url):
                out[str(p.relative_to(root))] = found
    return out


def test_a_url_passed_through_env_lands_only_in_a_private_file_and_still_reaches_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MY_HOOK", raising=False)
    overrides = [f"run_root={tmp_path / 'runs'}", "scheduler=slurm", "container.runtime=none",
                 "alerts.url_env=MY_HOOK", f"env.MY_HOOK={SECRET_URL}", "env.OTHER=kept"]
    assert cli.main(["submit", "--dry-run", str(QUICKSTART), *overrides]) == 0
    from tests.test_secrets import found_in

    assert found_in(capsys.readouterr().out, SECRET_URL) == []
    p = submit.write(submit.plan(QUICKSTART, overrides))
    assert leaked(p.run.root, skip=("secret.env",)) == {}
    secret = p.run.root / "secret.env"
    assert secret.stat().st_mode & 0o777 == 0o600 and SECRET_URL in secret.read_text()
    assert p.run.script.stat().st_mode & 0o777 == 0o755
    script = p.run.script.read_text()
    start, end = script.index("RUN_DIR="), script.index("# One thread per CPU")
    out = subprocess.run(["bash", "-c", script[start:end] + 'printf "%s|%s" "$MY_HOOK" "$OTHER"'],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == f"{SECRET_URL}|kept", out.stderr


WRITERS = """
import json, logging, sys
from pathlib import Path
from runner import log
from runner.parallel.store import Store
from runner.rundir import RunDir, atomic_write
from runner.spec.typed import read_resolved

run, url = RunDir(Path(sys.argv[1])), sys.argv[2]
token = url.rsplit("/", 1)[1]
read_resolved(run.config)  # what every writer of a run does first
log.setup(stamped=True)
handler = logging.FileHandler(run.root / "driver.log")  # as runner parallel's driver log
logging.getLogger("runner").addHandler(handler)
logging.getLogger("runner.host.parallel").warning("item 3 failed: POST %s: timed out", url)
run.record("exit", cause=f"ConnectionError: {url.split('://')[1]} unreachable")
atomic_write(run.crash_file(1, 0), json.dumps({"message": f"bad token {token}", "frame": url}) + "\\n")
Store(run).write(0, {1: f"fetched {url}"}, {2: f"HTTPError for url: {url}"})
handler.close()
"""


@pytest.mark.parametrize("source", ["url_env", "url_file", "env"])
def test_every_writer_of_a_run_directory_redacts_the_url_from_every_source(tmp_path: Path, source: str) -> None:
    """The ledger, a crash record, a parallel chunk and a driver log, written by a process that read the run's config
    (as the launcher, the hooks, cron and the parallel driver do), whichever source the URL came from."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUNNER_WEBHOOK_URL", "MY_HOOK")}
    overrides = [f"run_root={tmp_path / 'runs'}", "alerts.url_env=MY_HOOK"]
    if source == "url_env":
        env["MY_HOOK"] = SECRET_URL
    elif source == "url_file":
        secret = tmp_path / "private" / "hook"
        secret.parent.mkdir(mode=0o700)
        secret.write_text(SECRET_URL + "\n")
        secret.chmod(0o600)
        overrides.append(f"alerts.url_file={secret}")
    else:
        overrides.append(f"env.MY_HOOK={SECRET_URL}")
    p = submit.write(submit.plan(QUICKSTART, overrides))
    out = subprocess.run([sys.executable, "-c", WRITERS, str(p.run.root), SECRET_URL], capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert (p.run.root / "driver.log").read_text().count("redacted") == 1
    assert leaked(p.run.root, skip=("secret.env",)) == {}
    from tests.test_secrets import found_in

    assert found_in(out.stderr, SECRET_URL) == []
    (p.run.root / "ledger.jsonl").open("a").write(json.dumps(  # a ledger from before redaction
        {"time": 2, "event": "exit", "outcome": "failed", "cause": f"POST {SECRET_URL} failed"}) + "\n")
    shown = runner("status", "--json", "--root", str(tmp_path / "runs"), env={"RUNNER_WEBHOOK_URL": "",
                                                                              "MY_HOOK": env.get("MY_HOOK", "")})
    assert shown.returncode == 0 and "redacted" in shown.stdout, shown.stderr
    assert found_in(shown.stdout, SECRET_URL) == []


def test_a_wrong_shape_checkpoint_manifest_and_progress_are_skipped_and_the_older_checkpoint_resumes(
        tmp_path: Path) -> None:
    """A real local run (2 ranks) stopped after its step-20 checkpoint: that checkpoint's manifest.json is `null` and
    progress.json is `[1, 2]`. The resume names both in one line each, trains from step 10, and finishes."""
    args = [str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=20", "checkpoint.every_n_steps=10",
            "preflight.enabled=false"]
    env = {"OMP_NUM_THREADS": "1"}
    first = runner("submit", *args, env=env)
    assert first.returncode == 0, first.stderr
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (run / "finished").unlink()  # as if killed right after step 20's checkpoint
    import shutil

    shutil.rmtree(run / "final", ignore_errors=True)
    (run / "checkpoints" / "step-0000020" / "manifest.json").write_text("null\n")
    (run / "progress.json").write_text("[1, 2]\n")
    again = runner("resume", str(run), env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (run / "finished").exists()
    from runner.rundir import RunDir

    starts = [e for e in RunDir(run).events() if e["event"] == "train_start"]
    assert starts[-1]["step"] == 10
    log0 = (run / "logs" / "attempt-2" / "rank-00000.log").read_text()
    assert "progress.json: found a JSON list; expected an object; skipped as if it were missing" in log0
    assert "step-0000020: written by config None" in log0 or "step-0000020/manifest.json" in log0


def test_special_files_in_a_run_never_hang_cron_or_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FIFOs as a run's ledger, job_id and manifest: runner status and runner cron answer (a hang would end in the
    subprocess timeout), show that run as unreadable or skip it, and list the others."""
    root = tmp_path / "runs"
    runs = failed_slurm_runs(root, 4)
    for name, victim in zip(("ledger.jsonl", "job_id", "manifest.json"), runs, strict=False):
        (victim / name).unlink()
        os.mkfifo(victim / name)
    shown = runner("status", "--json", "--root", str(root))
    assert shown.returncode == 0, shown.stderr
    rows = {r["run"]: r for r in json.loads(shown.stdout)}
    assert len(rows) == 4 and rows[runs[2].name]["state"] == "unreadable"
    assert "a FIFO" in rows[runs[2].name]["error"]
    recorded_slurm(monkeypatch, 4)
    from runner.host import cron

    assert cron.run_once([root]) == 0  # in-process: a hang would never return
    from runner.rundir import RunDir

    assert [e["event"] for e in RunDir(runs[3]).events()].count("resubmitted") == 1


@pytest.mark.parametrize("text", ["null", "[]", "7", '"x"', "[1, 2]", '{"trainer": 5}', "{{{", "\xff"])
def test_a_damaged_run_config_is_one_line_for_resume_and_cancel(tmp_path: Path, text: str) -> None:
    (run,) = failed_slurm_runs(tmp_path / "runs", 1)
    (run / "config.yaml").write_bytes(text.encode("latin-1"))
    out = runner("resume", str(run), "--force")
    one_error(out, "config.yaml")


def test_a_run_the_user_cannot_write_is_one_line_for_cancel_and_resume(tmp_path: Path) -> None:
    """Run as root here, so permissions cannot stop a write: a read-only filesystem can (a bind mount of the run's
    own folder, made read-only). Without mount rights the test says so and skips."""
    (run,) = failed_slurm_runs(tmp_path / "runs", 1)
    made = subprocess.run(["mount", "--bind", "-o", "ro", str(run), str(run)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here: {made.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(run)], check=True)
        for cmd in (["cancel", str(run)], ["resume", str(run), "--force"]):
            out = runner(*cmd)
            assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
            assert len(out.stderr.strip().splitlines()) == 1 and "read-only" in out.stderr.lower(), out.stderr
    finally:
        subprocess.run(["umount", str(run)], check=False)


def test_a_damaged_parallel_chunk_is_recomputed_and_the_result_equals_a_clean_run(tmp_path: Path) -> None:
    conf = REPO / "conf" / "parallel-stats.yaml"
    args = [str(conf), f"run_root={tmp_path}", "parallel.items=400", "parallel.provider.num_samples=400",
            "parallel.chunk_size=50"]
    env = {"OMP_NUM_THREADS": "1", "RUNNER_WEBHOOK_URL": ""}
    assert runner("parallel", *args, env=env).returncode == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    chunks = run / "parallel" / "chunks"
    clean = (run / "parallel" / "result.json").read_text()
    (chunks / "chunk-000001.json").write_text("[1, 2]\n")  # a list
    two = json.loads((chunks / "chunk-000002.json").read_text())
    three = json.loads((chunks / "chunk-000003.json").read_text())
    two["results"]["150"] = three["results"]["150"]  # another chunk's item
    (chunks / "chunk-000002.json").write_text(json.dumps(two))
    (run / "parallel" / "result.json").unlink()
    again = runner("parallel", *args, env=env)
    assert again.returncode == 0, again.stderr
    assert "chunk-000001.json: found a JSON list" in again.stderr
    assert "chunk-000002.json: found items of another chunk" in again.stderr
    assert (run / "parallel" / "result.json").read_text() == clean
    from runner.parallel.store import Store
    from runner.rundir import RunDir

    assert [i for i, _ in Store(RunDir(run)).items()] == list(range(400))


def test_a_full_disk_is_named_as_such_whatever_words_the_writer_used(tmp_path: Path) -> None:
    """torch.save on a full file system raises its own "enforce fail ... unexpected pos"; the run directory's writer
    says "no space left on device" (a small tmpfs is the full disk; without mount rights the test skips)."""
    import errno

    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        import torch

        from runner.rundir import Unwritable, atomic_write

        with pytest.raises(Unwritable) as err:
            atomic_write(disk / "model.ckpt", lambda f: torch.save(torch.zeros(1 << 20), f))
        assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
        line = str(err.value)
        assert "no space left on device" in line and "\n" not in line and "unexpected pos" not in line
        assert not list(disk.iterdir())  # nothing half-written left behind
    finally:
        subprocess.run(["umount", str(disk)], check=False)
