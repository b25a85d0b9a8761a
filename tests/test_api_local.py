"""The Python API (``import runner``) with real processes: the quickstart submitted, waited on and read back; a bad
config raises the CLI's own error; ``import runner`` and the API pull in no torch or Lightning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import runner
from runner.errors import ConfigError, InputError, SubmitError
from tests.waiting import until

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks inherit it, as from `runner submit`


def test_submit_the_quickstart_wait_and_read_it_back(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run = runner.submit(QUICKSTART, f"run_root={root}", "trainer.max_steps=6")
    assert run.path.parent == root and (run.path / "config.yaml").is_file()
    assert run.state in ("running", "completed")  # back once the run recorded its start, not at its end
    assert run.wait(timeout=180) == "completed"
    assert run.ended() and (run.path / "finished").is_file()
    names = [e.event for e in run.events()]
    assert names[0] == "submitted" and "finished" in names and names[-1] == "exit"
    assert next(e for e in run.events() if e.event == "finished").fields["step"] == 6
    assert run.config["trainer"]["max_steps"] == 6
    assert "finished at step 6" in run.logs(rank=0)
    assert run.report() == run.report_path == run.path / "report.html" and run.report_path.is_file()
    found = runner.find("quickstart", root)
    assert found.path == run.path and found.state == "completed"
    assert [r.path for r in runner.runs(root)] == [run.path]
    assert run.sweep is None


def test_a_bad_config_raises_the_clis_error_with_its_text(tmp_path: Path) -> None:
    bad = ["trainer.max_steps=abc", "trainer.foo=1", f"run_root={tmp_path / 'runs'}"]
    cli = subprocess.run([sys.executable, "-m", "runner", "submit", str(QUICKSTART), *bad], capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 2
    with pytest.raises(ConfigError) as e:
        runner.submit(QUICKSTART, *bad)
    assert e.value.exit_code == 2
    assert [f"runner: error: {line}" for line in str(e.value).splitlines()] == cli.stderr.splitlines()
    assert len(e.value.problems) == 2 and not (tmp_path / "runs").exists()  # nothing written
    with pytest.raises(InputError, match="found no run directory under"):
        runner.find("nothing-here", tmp_path / "runs")


@pytest.mark.parametrize("code", [
    "import runner",
    "import runner; runner.submit; runner.Run; runner.plan_sweep",  # the API's module, imported on first use
    "import runner; runner.plan(sys.argv[1], 'run_root=' + sys.argv[2])",
])
def test_import_runner_pulls_in_no_torch_and_no_lightning(code: str, tmp_path: Path) -> None:
    probe = f"import sys\n{code}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in " \
            "('torch', 'lightning', 'numpy', 'pytorch_lightning')))"
    out = subprocess.run([sys.executable, "-c", probe, str(QUICKSTART), str(tmp_path / "runs")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_plan_is_inspected_then_executed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    plan = runner.plan(QUICKSTART, f"run_root={root}", "trainer.max_steps=2")
    assert plan.world_size == 2 and "job.sbatch" in plan.files and "--- config.yaml ---" in str(plan)
    assert not root.exists()  # planning writes nothing
    run = runner.execute(plan)
    assert run.path == plan.run.root
    assert run.wait(timeout=180) == "completed"


def test_cancel_then_a_refused_resume_then_a_resume_to_the_end(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run = runner.submit(QUICKSTART, f"run_root={root}", "trainer.max_steps=60", "model.step_time_s=0.05")
    until("the run to train", lambda: any(e.event == "train_start" for e in run.events()), 120)
    run.cancel()
    assert run.state == "cancelled" and run.ended()
    with pytest.raises(SubmitError) as e:  # refused in the background driver, raised here with the CLI's text
        run.resume("trainer.max_steps=80")
    assert str(e.value).startswith(f"resume {run.name}: found an override of trainer.max_steps; expected only "
                                   "num_nodes or num_device")
    assert run.resume() is run
    assert run.wait(timeout=180) == "completed"
    assert [e.event for e in run.events()].count("resubmitted") == 1 and run.dir.attempts() == [1, 2]
