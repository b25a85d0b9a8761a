"""The scheduler seam (runner/host/scheduler.py): one interface, two schedulers, chosen in one place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner import policy, spec
from runner.host import scheduler, status, submit
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

RUNNER = Path(__file__).resolve().parents[1] / "runner"


@pytest.mark.parametrize(("name", "chosen"), [
    ("local", scheduler.LOCAL),
    ("slurm", scheduler.SLURM),
    ("SLURM", scheduler.RECORDS),  # names are exact, as the schema's choices
    ("pbs", scheduler.RECORDS),
    (None, scheduler.RECORDS),  # a manifest without the key (torn, hand-made)
    (["slurm"], scheduler.RECORDS),  # a hostile manifest: never a TypeError
    ({"a": 1}, scheduler.RECORDS),
    (3, scheduler.RECORDS),
])
def test_a_name_chooses_one_scheduler(name: object, chosen: scheduler.Scheduler) -> None:
    assert scheduler.of(name) is chosen
    assert scheduler.of_manifest({"scheduler": name}) is chosen


@pytest.mark.parametrize("manifest", [None, [], "slurm", 7])
def test_a_manifest_that_is_no_object_has_no_scheduler(manifest: object) -> None:
    assert scheduler.of_manifest(manifest) is scheduler.RECORDS


@pytest.mark.parametrize(("sched", "queue", "detached"), [
    (scheduler.LOCAL, False, False),  # the attempt runs here; its lock, not a queue, says it lives
    (scheduler.SLURM, True, True),  # sbatch returns once queued; squeue/sacct know the job
    (scheduler.RECORDS, False, False),  # nothing to ask but the run directory
])
def test_what_each_scheduler_can_answer(sched: scheduler.Scheduler, queue: bool, detached: bool) -> None:
    assert (sched.queue, sched.detached) == (queue, detached)


QUICKSTART = RUNNER.parent / "conf" / "quickstart.yaml"


def _config(tmp_path: Path, *overrides: str) -> spec.Config:
    return spec.load(QUICKSTART, [f"run_root={tmp_path / 'runs'}", *overrides])


@pytest.mark.parametrize(("overrides", "uses"), [
    (["scheduler=slurm", "container.runtime=apptainer"], True),
    (["scheduler=slurm", "container.runtime=none"], False),  # the job runs on the hosts' own Python
    (["scheduler=local"], False),  # a local run starts the launcher here
])
def test_only_a_slurm_job_in_a_container_uses_the_image(tmp_path: Path, overrides: list[str], uses: bool) -> None:
    cfg = _config(tmp_path, *overrides)
    assert scheduler.of(cfg.data["scheduler"]).uses_image(cfg) is uses


def _facts(tmp_path: Path, *overrides: str, bad: tuple[str, ...] = ()) -> submit.Facts:
    """A plan's facts made by hand: no git, no podman, no nodes file, no clock."""
    run = RunDir(tmp_path / "runs" / "quickstart-20260101-000000")
    cfg = spec.load(QUICKSTART, [f"run_root={tmp_path / 'runs'}", *overrides], run_dir=str(run.root))
    return submit.Facts(cfg, run, "img.sif", None, None, {"commit": "abc"}, "", [], list(bad), "login1", "/work",
                        1.0)


def test_a_plan_is_its_facts_alone(tmp_path: Path) -> None:
    """``submit.make`` asks the system nothing: the same facts give the same plan, and no file is written."""
    f = _facts(tmp_path, "scheduler=slurm", "container.runtime=none")
    a = submit.make(f, QUICKSTART, ["scheduler=slurm"])
    assert str(a) == str(submit.make(f, QUICKSTART, ["scheduler=slurm"]))
    assert not (tmp_path / "runs").exists()
    assert '"created": 1.0' in a.files["manifest.json"] and '"host": "login1"' in a.files["manifest.json"]


def test_the_dry_run_lists_every_command_a_submission_may_run(tmp_path: Path) -> None:
    """The bad nodes left out, each fallback sbatch lets the oldest back in, and the successor's sbatch."""
    f = _facts(tmp_path, "scheduler=slurm", "container.runtime=none", "resume.successor=true", bad=("n3", "n1"))
    p = submit.make(f, QUICKSTART, [])
    script = str(f.run.script)
    assert p.argv == ["sbatch", "--parsable", "--exclude=n1,n3", script]
    also = [n for n in p.notes if n.startswith("may also run:")]
    assert also == [f"may also run:  sbatch --parsable --exclude=n1 {script}  "
                    "(too few nodes without them: n3 let back in)",
                    f"may also run:  sbatch --parsable {script}  (too few nodes without them: n3,n1 let back in)",
                    f"may also run:  sbatch --parsable --exclude=n1,n3 --dependency=afternotok:JOB "
                    f"--kill-on-invalid-dep=yes {script}  (the successor, JOB being the job sbatch named)"]
    assert all(line in str(p) for line in also)
    local = submit.make(_facts(tmp_path, "scheduler=local", bad=("n3",)), QUICKSTART, [])
    assert not [n for n in local.notes if n.startswith(("may also run:", "bad nodes:"))]  # no queue, no nodes


def test_a_local_run_without_its_lock_is_not_running(tmp_path: Path) -> None:
    """Its processes hold the owner lock while any lives: none holds it, so the ledger's start is history."""
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    run.record("start", attempt=1)
    rec = policy.Records(events=run.events(), exit_status=None, finished=False)
    assert scheduler.LOCAL.state(run, rec, None, None) == policy.local_run_state(rec, False)
    assert scheduler.LOCAL.ended(run, None, run.events()) is True
    assert scheduler.RECORDS.ended(run, None, run.events()) is False  # nothing known ends it: status keeps following


def test_a_slurm_run_without_a_job_id_has_not_ended(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    assert scheduler.SLURM.ended(run, None, []) is False


def test_status_asks_the_scheduler_the_manifest_names(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    run.manifest.write_text('{"scheduler": "local"}')
    run.record("start", attempt=1)
    assert status.ended(run) is True  # no process holds the lock
    run.manifest.write_text('{"scheduler": ["local"]}')
    assert status.ended(run) is False


@pytest.mark.parametrize(("records", "finished", "held", "manifest", "want"), [
    # the ranks still run after rank 0's `finished` marker and its last log lines: `logs --follow` keeps reading
    (("start", "finished"), True, True, "local", False),
    (("start", "finished"), True, False, "local", True),
    (("start", "cancelled"), False, True, "local", False),  # the ranks checkpoint and exit after the record
    (("start", "finished", "exit"), True, True, "local", True),  # the job's exit is recorded after its ranks'
    (("start", "gave_up"), False, True, "local", True),
    (("start",), False, True, "local", False),
    (("start", "finished"), True, True, "neither", True),  # no scheduler to ask: the run's own word
    (("start",), False, True, "neither", False),
])
def test_a_run_ended_once_its_processes_have(tmp_path: Path, records: tuple[str, ...], finished: bool, held: bool,
                                              manifest: str, want: bool) -> None:
    import fcntl

    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    run.manifest.write_text(f'{{"scheduler": "{manifest}"}}')
    for event in records:
        run.record(event)  # type: ignore[call-overload]
    if finished:
        run.finished.write_text("{}")
    with open(run.owner_lock, "a") as lock:
        if held:  # a live local run holds its owner lock
            fcntl.flock(lock, fcntl.LOCK_EX)
        assert status.ended(run) is want


_COMPARISON = re.compile(r"""scheduler["'\]\)]*\s*[!=]=|[!=]=\s*["'](?:local|slurm)["']\s*(?:#|$|\)|:| and| or)""")


def test_no_module_but_the_seam_compares_scheduler_names() -> None:
    """The seam is the one place a scheduler's name is compared; everything else asks the scheduler it was given."""
    found = [f"{p.relative_to(RUNNER)}:{n}: {line.strip()}"
             for p in sorted(RUNNER.rglob("*.py")) if p.name != "scheduler.py"
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "scheduler" in line and _COMPARISON.search(line)]
    assert found == []


def test_the_guard_finds_a_comparison() -> None:
    for line in ('if p.scheduler == "slurm":', 'x = manifest.get("scheduler") == "local"',
                 'if cfg.data["scheduler"] != "slurm" or y:'):
        assert _COMPARISON.search(line), line
