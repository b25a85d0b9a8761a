"""A first hour without surprises, the unit tier: every alert's "Next:" line as a table (the runs:
tests/test_first_hour.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner import policy, spec
from runner.alerts import nextstep
from runner.errors import ConfigError
from tests.test_policy import Limits

pytestmark = pytest.mark.unit


LIMITS = Limits(requeue=True, max_restarts=3)


EXIT = {"event": "exit", "outcome": "failed", "time": 1.0}


def slurm_next(outcome: str) -> str:
    """What the exit hook's alert says for a Slurm training run's first attempt ending with ``outcome``."""
    events = [{"event": "submitted", "time": 0.0}, {**EXIT, "outcome": outcome}]
    decision = policy.after_exit(outcome, 1, "7", LIMITS, events)
    requeued = True if decision.action == "requeue" else None
    return nextstep.next_step(outcome, decision, 1, LIMITS, requeued, events)


# (scheduler, workload, outcome) -> what the "Next:" line must say, and what it must not (a promise not kept there).
NEXT_STEPS = [
    ("slurm", "training", "failed", "runner cron resubmits it", None),
    ("slurm", "training", "hang", "runner cron resubmits it", None),
    ("slurm", "training", "preempted", "requeued as attempt 2", "runner resume"),
    ("slurm", "training", "timeout", "requeued as attempt 2", "runner resume"),
    ("slurm", "training", "nan", "stopped, not retried", "cron resubmits"),
    ("slurm", "training", "preflight_failed", "not retried", "cron resubmits"),
    ("local", "training", "failed", "`runner resume run-x`", "cron resubmits it"),
    ("local", "training", "hang", "`runner resume run-x`", "cron resubmits it"),
    ("local", "training", "nan", "fix the model or data", "cron resubmits it"),
    ("local", "training", "preflight_failed", "fix the check", "cron resubmits it"),
    ("local", "training", "completed", "nothing: training finished", "resume"),
    # A program's stage that trains nothing (ESPnet3's create_dataset, infer, measure): runner holds no checkpoint.
    ("local", "stage", "failed", "`runner resume run-x` runs its command again", "newest complete checkpoint"),
    ("local", "stage", "cancelled", "runs its command again", "newest complete checkpoint"),
    ("local", "stage", "completed", "nothing: the run finished", "training"),
    ("local", "parallel", "failed", "`runner resume run-x` runs the items not done", "cron resubmits it"),
    ("local", "parallel", "completed", "every item is done", "resume"),
]


@pytest.mark.parametrize(("scheduler", "workload", "outcome", "says", "never"), NEXT_STEPS)
def test_each_next_line_says_what_happens_next(scheduler: str, workload: str, outcome: str, says: str,
                                               never: str | None) -> None:
    if workload == "parallel":
        text = nextstep.parallel_next_step(outcome, "run-x")
    elif scheduler == "local":
        text = nextstep.local_next_step(outcome, "run-x", saved=workload == "training")
    else:
        text = slurm_next(outcome)
    assert says in text, text
    assert never is None or never not in text, text


# Issue 38's first hour, the config side: what `runner validate` says is what `runner submit` does.

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
PROGRAM = "num_nodes: 1\nnum_device: 2\ncommand: {command}\n"


def conf(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf.yaml"
    path.write_text(text)
    return path


def refusal(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        spec.load(path, overrides or [])
    [line] = err.value.problems
    return line


def test_a_local_run_without_a_runtime_runs_with_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    path = conf(tmp_path, PROGRAM.format(command="python train.py"))
    assert spec.load(path).data["container"]["runtime"] == "none"  # scheduler: local, no container: section
    assert spec.load(path, ["container.pip=[x]"]).data["container"]["runtime"] == "none"
    assert spec.load(path, ["scheduler=slurm"]).data["container"]["runtime"] == "apptainer"
    assert spec.load(path, ["scheduler=slurm", "container.runtime=podman"]).data["container"]["runtime"] == "podman"
    # Written by the user: kept, and a local run of an image's runtime is refused by validate as by submit.
    line = refusal(path, ["container.runtime=apptainer"])
    assert "container.runtime: found apptainer with scheduler: local; expected none" in line, line
    assert "runner build" in line and "scheduler: slurm" in line
    own = yaml.safe_load(QUICKSTART.read_text())
    del own["container"]
    assert spec.load(conf(tmp_path, yaml.safe_dump(own))).data["container"]["runtime"] == "none"


def test_validate_refuses_a_run_root_sbatch_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a b").mkdir()
    monkeypatch.chdir(tmp_path / "a b")  # a relative run_root is relative to here, as submit resolves it
    line = refusal(QUICKSTART)
    assert "run_root: found 'runs'; expected a path of letters" in line and "sbatch" in line, line


@pytest.mark.parametrize(("command", "needle"), [
    ("python nope.py --config x", "no script 'nope.py' in"),
    ("python sub/nope.py", "no script 'sub/nope.py' in"),
    ("python", "reads its program from stdin"),
    ("python -u", "reads its program from stdin"),
    ("python -", "reads its program from stdin"),
    ("python -u - x", "reads its program from stdin"),
    ("python -i train.py", "stdin"),
    ("bash", "reads its commands from stdin"),
    ("sh -s", "reads its commands from stdin"),
    ("./nope.sh", "no command './nope.sh' in"),
])
def test_a_command_that_cannot_start_or_reads_stdin_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               command: str, needle: str) -> None:
    monkeypatch.chdir(tmp_path)  # the directory the ranks start in: where runner submit runs
    (tmp_path / "train.py").write_text("")
    line = refusal(conf(tmp_path, PROGRAM.format(command=command)))
    assert line.startswith(f"{tmp_path / 'conf.yaml'}:3: command: found ") and needle in line, line
    assert "hint: " in line


@pytest.mark.parametrize("command", ["python train.py", "python -u -W ignore train.py --x -", "python -m runner",
                                     "python -c pass", "python3 -X dev sub/t.py", "bash run.sh", "sh -c 'echo hi'",
                                     "torchrun --nproc-per-node 2 train.py", "./run.sh"])
def test_a_command_that_starts_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    for name in ("train.py", "sub/t.py", "run.sh"):
        (tmp_path / name).write_text("")
    assert spec.load(conf(tmp_path, PROGRAM.format(command=command))).program_mode


@pytest.mark.parametrize("code", [81, 2], ids=["exit 81 (the program cannot train)", "exit 2 (a usage error)"])
@pytest.mark.parametrize("scheduler", ["local", "slurm"])
def test_after_a_command_that_cannot_run_next_says_fix_it_and_submit_again(scheduler: str, code: int) -> None:
    """A resume runs the same command with the same config: after exit 81 or 2 it would fail the same way."""
    events = [{"event": "submitted", "time": 0.0}, {**EXIT, "exit_code": code}]
    if scheduler == "local":
        text = nextstep.local_next_step("failed", "run-x", exit_code=code)
    else:
        decision = policy.after_exit("failed", 1, "7", LIMITS, events)
        assert decision.action == "stop", decision  # another attempt would end the same way: never requeued
        text = nextstep.next_step("failed", decision, 1, LIMITS, None, events)
    assert "submit" in text and "runner resume" not in text and "cron resubmits" not in text, text
    assert "runner resume" not in nextstep.cause_step("program")


# `runner status`'s LAST column: the latest ended attempt's outcome (a cancel ends one), on one clean line.

FAILED_EXIT = {"event": "exit", "outcome": "failed", "exit_code": 1, "attempt": 1, "time": 2.0,
               "cause": "OOM on rank 3\n  torch.cuda.OutOfMemoryError: CUDA out of memory"}


@pytest.mark.parametrize(("after", "outcome"), [
    ([], "failed"),
    ([{"event": "resubmitted", "by": "user", "time": 3.0}], "failed"),  # what made it resubmit, until the next ends
    ([{"event": "start", "job_id": "8", "time": 3.0}], "failed"),
    ([{"event": "resubmitted", "by": "user", "time": 3.0}, {"event": "cancelled", "job_id": "8", "time": 4.0}],
     "cancelled"),  # cancelled before it ended: never the previous attempt's "failed"
    ([{"event": "cancelled", "job_id": "7", "time": 3.0},
      {"event": "exit", "outcome": "cancelled", "exit_code": 0, "attempt": 2, "time": 4.0}], "cancelled"),
], ids=["its exit", "resumed", "started", "resumed then cancelled", "cancelled, then its exit"])
def test_status_last_outcome_is_the_latest_ended_attempts(after: list[dict[str, object]], outcome: str | None) -> None:
    from runner.host import status

    events = [{"event": "submitted", "time": 0.0}, {"event": "start", "time": 1.0}, FAILED_EXIT, *after]
    assert status.last_outcome(events)[0] == outcome


def test_status_last_column_is_one_clean_line() -> None:
    from runner.host import status

    cell = status.last_cell("failed", FAILED_EXIT["cause"])
    assert "\n" not in cell and "  " not in cell and cell.startswith("failed: OOM on rank 3 torch.cuda"), cell
    long = status.last_cell("hang", "hang: all 2 ranks in forward since step 40 (not responding for 31 s); rank 1 "
                                    "on node-a stopped first")
    assert long.count("hang:") == 1 and len(long) <= 80 and long.endswith("..."), long
    assert not long[:-3].endswith(" ") and long[:-3].split()[-1] in "hang: all 2 ranks in forward since step 40 (not "\
        "responding for 31 s); rank 1 on node-a stopped first".split(), long  # cut between words
    assert status.last_cell("completed", None) == "completed" and status.last_cell(None, None) == "-"
