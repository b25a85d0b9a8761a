"""runner sweep with real processes: a 2 x 3 grid of the quickstart run 2 at a time, `runner status` grouping it, a
sweep resumed after its driver and a point were killed, and a Slurm sweep's job array (dry run, no cluster) run by
bash and submitted to a stub sbatch (tables of the grid and its bad input: tests/test_sweep_unit.py; the array on the
dev cluster: tests/test_sweep_cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import runner
from runner.host import sweep
from runner.rundir import RunDir
from tests.test_render import lint
from tests.waiting import until

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def manifest(run: Path) -> dict[str, object]:
    m = json.loads((run / "manifest.json").read_text())
    assert isinstance(m, dict)
    return m


def test_a_2x3_grid_runs_2_at_a_time_and_status_groups_it(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    out = cli("sweep", str(QUICKSTART), "model.lr=0.01,0.1", "model.hidden=8,16,24", "trainer.max_steps=3",
              f"run_root={root}", "--parallel", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    runs = sorted(p for p in root.iterdir() if p.name.startswith("quickstart-"))
    assert len(runs) == 6
    marks = [manifest(r)["sweep"] for r in runs]
    assert len({m["id"] for m in marks}) == 1  # type: ignore[index]
    sweep_id = marks[0]["id"]  # type: ignore[index]
    seen = set()
    for run, mark in zip(runs, marks, strict=True):
        assert (run / "finished").is_file(), run
        cfg = runner.find(run.name, root).config  # the resolved config: the point's values applied
        point = mark["point"]  # type: ignore[index]
        assert point == {"model.lr": str(cfg["model"]["lr"]), "model.hidden": str(cfg["model"]["hidden"])}
        assert cfg["trainer"]["max_steps"] == 3
        seen.add((cfg["model"]["lr"], cfg["model"]["hidden"]))
    assert seen == {(lr, h) for lr in (0.01, 0.1) for h in (8, 16, 24)}
    # 2 at a time: some point started before another ended, and never 3 at once
    spans = sorted((RunDir(r).events()[0]["time"], RunDir(r).events()[-1]["time"]) for r in runs)
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlap == 2
    assert out.stdout.rstrip().endswith(f"sweep {sweep_id}: 6 completed")

    table = cli("status", "--root", str(root))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    head = lines.index(f"sweep {sweep_id}: 6 of 6 runs, 6 completed")
    members = lines[head + 1:head + 7]
    assert [line.split()[0] for line in members] == [r.name for r in runs]
    assert all(line.startswith("  ") and " completed " in line for line in members)
    assert "model.lr=0.01 model.hidden=8 " in members[0] and "model.lr=0.1 model.hidden=24 " in members[5]
    rows = json.loads(cli("status", "--root", str(root), "--json").stdout)
    assert {r["sweep"]["id"] for r in rows} == {sweep_id}
    assert [r.path for r in runner.runs(root, sweep=sweep_id)] == runs


def test_a_sweep_resumed_after_a_crash_runs_only_what_is_not_finished(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    driver = subprocess.Popen([sys.executable, "-m", "runner", "sweep", str(QUICKSTART), "model.lr=0.01,0.02,0.03",
                               "trainer.max_steps=40", "model.step_time_s=0.05", f"run_root={root}"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = until("the sweep's record", lambda: next((root / "sweeps").glob("*/sweep.json"), None), 60).parent
    s = sweep.SweepDir(folder)

    def second_trains() -> bool:
        got = s.runs()
        return len(got) == 3 and (got[0].finished.exists() and any(
            e["event"] == "train_start" for e in got[1].events()))

    until("point 0 to finish and point 1 to train", second_trains, 180,
          detail=lambda: {i: r.events() for i, r in s.runs().items()})
    first, second, third = (s.runs()[i] for i in range(3))
    driver.kill()  # the machine's crash: the sweep's driver, point 1's driver and its ranks die at once
    driver.wait(10)
    owner = json.loads(second.local_owner.read_text())
    for pid in [owner["pid"], *owner["ranks"]]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    import shutil

    shutil.rmtree(third.root)  # ... before the driver had written point 2's run directory
    until("point 1's processes to be gone", lambda: not runner.find(second.root, root).state == "running", 30)
    before = first.ledger.read_bytes()

    out = cli("sweep", "--resume", s.id, "--root", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert first.ledger.read_bytes() == before  # a completed point is left as it is
    assert first.attempts() == [1]
    assert second.attempts() == [1, 2] and second.finished.exists()
    assert [e["event"] for e in second.events()].count("resubmitted") == 1
    again = s.runs()[2]
    assert again.root != third.root and again.finished.exists() and again.attempts() == [1]
    assert runner.find_sweep(s.id, root).states() == {0: "completed", 1: "completed", 2: "completed"}
    assert cli("sweep", "--resume", s.id, "--root", str(root)).stdout.count(": completed") == 3  # nothing to run


def test_a_slurm_sweeps_dry_run_is_one_job_array_whose_task_i_runs_point_i(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    args = [str(QUICKSTART), "model.lr=0.01,0.1", "model.hidden=8,16,24", "scheduler=slurm", f"run_root={root}",
            "--parallel", "2"]
    out = cli("sweep", "--dry-run", *args)
    assert out.returncode == 0, out.stderr
    assert not root.exists()  # a dry run writes nothing
    assert "one job array, at most 2 tasks at a time" in out.stdout
    table = out.stdout.split("POINT", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.split()[0] for line in table] == [str(i) for i in range(6)]
    array = out.stdout.split("array.sbatch ---\n", 1)[1]
    assert "#SBATCH --array=0-5%2\n" in array and array.count("#SBATCH --array") == 1
    listed = array.split("RUN_DIRS=(\n", 1)[1].split("\n)", 1)[0].split()
    assert [Path(p).name for p in listed] == [line.split()[1] for line in table]
    assert [line.split()[2:] for line in table] == [[f"model.lr={lr}", f"model.hidden={h}"] for lr in ("0.01", "0.1")
                                                     for h in (8, 16, 24)]
    lint("shellcheck", "-s", "bash", text=array, tmp_path=tmp_path, name="array.sbatch")

    # The array script run by bash as Slurm runs task 4: it becomes point 4's own batch script, output in its logs.
    plan = runner.plan_sweep(QUICKSTART, *args[1:-2], parallel=2)
    assert plan.array is not None and plan.argv == ["sbatch", "--parsable", str(plan.sweep.array)]
    for p in plan.plans:
        (p.run.logs).mkdir(parents=True)
        p.run.script.write_text('#!/bin/bash\necho "task of $PWD $0 ${SLURM_ARRAY_TASK_ID}"\n')
        p.run.script.chmod(0o755)
    script = tmp_path / "array.sbatch"
    script.write_text(plan.array)
    env = {**ENV, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_JOB_ID": "77"}
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    fourth = plan.plans[4].run
    assert fourth.batch_log("77_4").read_text() == f"task of {tmp_path} {fourth.script} 4\n"
    assert plan.plans[4].source is not None and plan.points[4] == (("model.lr", "0.1"), ("model.hidden", "16"),
                                                                   ("scheduler", "slurm"), ("run_root", str(root)))
    mark = json.loads(plan.plans[4].files["manifest.json"])["sweep"]
    assert mark == {"id": plan.id, "index": 4, "size": 6, "point": {"model.lr": "0.1", "model.hidden": "16"}}


def stub_sbatch(tmp_path: Path, answer: str) -> dict[str, str]:
    """An sbatch on PATH that logs its submissions and says ``answer`` (a job id, or an error and exit 1); asked its
    version (``runner submit`` does, for --requeue=expedite), it is Slurm 22.05's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    said = f'echo "{answer}"' if answer.isdigit() else f'echo "sbatch: error: {answer}" >&2; exit 1'
    version = 'if [ "$1" = --version ]; then echo "slurm 22.05.8"; exit 0; fi'
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\n{version}\necho "$@" >>{tmp_path}/sbatch.log\n{said}\n')
    (bin_dir / "sbatch").chmod(0o755)
    return {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}"}


def test_a_slurm_sweep_is_submitted_as_one_job_array_whose_task_i_is_point_is_job(tmp_path: Path) -> None:
    """Each run records its task, ARRAYJOB_i, as its job (what the task records itself, and what Slurm's commands
    take); the array is one sbatch (the dev cluster runs it: tests/test_sweep_cluster.py)."""
    root = tmp_path / "runs"
    env = stub_sbatch(tmp_path, "4242")
    out = subprocess.run([sys.executable, "-m", "runner", "sweep", str(QUICKSTART), "model.lr=0.01,0.1,0.2",
                          "scheduler=slurm", f"run_root={root}", "--parallel", "2"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    [folder] = (root / "sweeps").iterdir()
    assert (tmp_path / "sbatch.log").read_text() == f"--parsable {folder / 'array.sbatch'}\n"  # one sbatch in all
    assert "#SBATCH --array=0-2%2\n" in (folder / "array.sbatch").read_text()
    assert json.loads((folder / "sweep.json").read_text())["job"] == "4242"
    runs = sweep.SweepDir(folder).runs()
    assert [runs[i].job_id() for i in range(3)] == ["4242_0", "4242_1", "4242_2"]
    for i, run in runs.items():
        [submitted] = [e for e in run.events() if e["event"] == "submitted"]
        assert submitted["job_id"] == f"4242_{i}" and submitted["scheduler"] == "slurm"
        assert f"{run.name}: job 4242_{i} (model.lr={('0.01', '0.1', '0.2')[i]})" in out.stdout
    assert "submitted job array 4242 (3 tasks, at most 2 at a time)" in out.stdout


def test_a_slurm_sweeps_resume_submits_only_the_points_that_never_got_a_job(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The submitter died after writing the runs, before sbatch: --resume submits each such point as a job of its own
    (one never written is planned first); a point with a job is its job's (and cron's)."""
    root = tmp_path / "runs"
    monkeypatch.chdir(REPO)
    written = sweep.prepare(sweep.plan(QUICKSTART, ["model.lr=0.01,0.1,0.2", "scheduler=slurm", f"run_root={root}"]))
    (written.plans[0].run.job_id_file).write_text("4000_0\n")  # point 0 got its task before the crash
    shutil.rmtree(written.plans[2].run.root)  # point 2 was never written
    env = stub_sbatch(tmp_path, "4300")
    out = subprocess.run([sys.executable, "-m", "runner", "sweep", "--resume", written.id, "--root", str(root)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job 4000_0: left to it" in out.stdout
    runs = written.sweep.runs()
    assert [runs[i].job_id() for i in range(3)] == ["4000_0", "4300", "4300"]
    assert (tmp_path / "sbatch.log").read_text().count("\n") == 2  # points 1 and 2, each a plain job


def test_a_slurm_sweep_sbatch_refuses_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    env = stub_sbatch(tmp_path, "Batch job submission failed: Invalid partition name specified")
    out = subprocess.run([sys.executable, "-m", "runner", "sweep", str(QUICKSTART), "model.lr=0.01,0.1",
                          "scheduler=slurm", f"run_root={root}"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "sbatch refused the job: Batch job submission failed: Invalid partition name specified" in out.stderr
    assert [p.name for p in root.iterdir()] == ["sweeps"] and not any((root / "sweeps").iterdir())


def test_explicit_points_from_a_file_each_take_the_grid(tmp_path: Path) -> None:
    points = tmp_path / "points.yaml"
    points.write_text("- {model.lr: 0.01, model.hidden: 8}\n- model: {lr: 0.003}\n")
    out = cli("sweep", "--dry-run", str(QUICKSTART), "--points", str(points), "trainer.max_steps=2,4",
              f"run_root={tmp_path}/runs")
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("POINT", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.split()[2:] for line in table] == [
        ["model.lr=0.01", "model.hidden=8", "trainer.max_steps=2"], ["model.lr=0.01", "model.hidden=8",
                                                                      "trainer.max_steps=4"],
        ["model.lr=0.003", "trainer.max_steps=2"], ["model.lr=0.003", "trainer.max_steps=4"]]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 3\n")
    out = cli("sweep", "--dry-run", str(QUICKSTART), "--points", str(bad))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "point 1: found int" in out.stderr
