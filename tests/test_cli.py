"""The CLI: fast paths never import torch or lightning, dry runs write nothing, the wheel carries templates."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from runner import cli, proc

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
PROBE = """
import sys
from runner.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "lightning", "numpy") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["validate", str(QUICKSTART)],
                                  ["submit", "--dry-run", str(QUICKSTART)],
                                  ["submit", "--dry-run", str(REPO / "conf" / "ngc-4x8gpu.yaml")],
                                  ["status", "--json"]])
def test_fast_paths_do_not_import_torch(args: list[str], tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stderr or out.stderr.rstrip().endswith("HEAVY=")


def test_dry_run_prints_plan_and_writes_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "runner", "submit", "--dry-run", str(QUICKSTART),
                          f"run_root={tmp_path}/runs"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--- job.sbatch ---" in out.stdout and "--- manifest.json ---" in out.stdout
    assert "global batch:  32 = 8 x 2 ranks x 2 accumulation" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_python_dash_m_runner_matches_console_script() -> None:
    a = subprocess.run([sys.executable, "-m", "runner", "--version"], capture_output=True, text=True, timeout=60)
    b = subprocess.run([str(Path(sys.executable).parent / "runner"), "--version"], capture_output=True, text=True,
                       timeout=60)
    assert a.stdout == b.stdout and a.stdout.startswith("runner ")


def test_wheel_carries_templates_and_renders_elsewhere(tmp_path: Path) -> None:
    """Build the wheel, install it into a fresh venv (no torch), render from another directory."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
                   check=True, timeout=300)
    [wheel] = dist.glob("runner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"runner/templates/sbatch.sh.j2", "runner/templates/Dockerfile.j2",
            "runner/templates/apptainer.def.j2"} <= set(names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=600, env={**os.environ, "PIP_NO_INPUT": "1"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([str(venv / "bin" / "runner"), "submit", "--dry-run", str(QUICKSTART)], cwd=elsewhere,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --ntasks-per-node=2" in out.stdout
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, timeout=60).stdout
    assert not {"torch", "lightning"} & {p["name"] for p in json.loads(freeze)}


@pytest.fixture
def runner_logger() -> logging.Logger:
    """The ``runner`` logger, put back as it was after a test that configured it through the CLI."""
    logger = logging.getLogger("runner")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.mark.parametrize(("argv", "env", "level"), [
    ([], None, logging.INFO), (["-v"], None, logging.DEBUG), (["--quiet"], None, logging.WARNING),
    (["-q", "validate", "-v"], None, logging.DEBUG), ([], "1", logging.DEBUG)])
def test_verbosity_flags(argv: list[str], env: str | None, level: int, runner_logger: logging.Logger,
                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RUNNER_VERBOSE", raising=False)
    if env:
        monkeypatch.setenv("RUNNER_VERBOSE", env)
    args = argv if "validate" in argv else [*argv, "validate"]
    assert cli.main([*args, str(QUICKSTART)]) == 0
    assert runner_logger.level == level
    capsys.readouterr()
    proc.run([sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert (f"+ {sys.executable} -c pass" in err) == (level == logging.DEBUG), err


def test_logs_of_a_run_from_before_attempt_folders(tmp_path: Path) -> None:
    run = tmp_path / "old-run"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("name: old\n")
    (run / "logs" / "rank-00000.log").write_text("trained\n")
    out = subprocess.run([sys.executable, "-m", "runner", "logs", str(run)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"runner: error: run old-run predates per-attempt logs: found {run}/logs/rank-*.log, "
                          f"expected {run}/logs/attempt-N/. hint: read those files directly\n")
