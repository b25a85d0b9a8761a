"""A config says what it means (issue 13), the tests that start processes (the local tier; the rest:
tests/test_spec_hardening.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner import cli
from tests.test_spec_hardening import BORING, QUICKSTART_TEXT, write

pytestmark = pytest.mark.local


def test_static_resolution_imports_neither_torch_nor_lightning(tmp_path: Path) -> None:
    path = write(tmp_path, BORING)
    probe = ("import sys; from runner.cli import main; rc = main(['-q', 'validate', sys.argv[1]]); "
             "print(rc, sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_data_module_without_dataloader_is_said_and_recorded(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, BORING)
    over = [f"run_root={tmp_path}/runs"]
    assert cli.main(["validate", str(path), *over]) == 0
    assert "does not take `dataloader`" in capsys.readouterr().err
    assert cli.main(["submit", str(path), "--dry-run", *over]) == 0
    out = capsys.readouterr()
    assert "does not take `dataloader`" in out.out
    manifest = json.loads(out.out.split("--- manifest.json ---\n")[1].split("\n--- ")[0])
    assert manifest["data_module"]["takes_dataloader"] is False
    assert manifest["data_module"]["global_batch"] == "the data module's own"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [
    ["submit", "CONF", "--dry-run", "trainer.max_steps=5"],
    ["submit", "CONF", "trainer.max_steps=5", "--dry-run", "seed=3"],
    ["build", "CONF", "--dry-run", "seed=3"],
    ["validate", "CONF", "-q", "seed=3"],
])
def test_flags_and_overrides_in_any_order(tmp_path: Path, argv: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, QUICKSTART_TEXT)
    argv = [str(path) if a == "CONF" else a for a in argv] + [f"run_root={tmp_path}/runs",
                                                               f"container.image_dir={tmp_path}/img"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if argv[0] == "build":  # the image does not depend on the seed: a dry run (not a build) is what shows
        assert "Dockerfile" in out, out
    else:  # each override took effect wherever it stood
        for override, line in (("trainer.max_steps=5", "max_steps: 5"), ("seed=3", "seed: 3")):
            if override in argv:
                assert line in out, f"{override}: no {line!r} in\n{out}"
