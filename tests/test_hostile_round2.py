"""Nothing lost, nothing leaked, never stuck: the second hostile round (issue 30).

Each section is one bullet of the issue's "Why"; every test failed on the code before its fix. Real parts only: real
run directories, real FIFOs, a real HTTP server (``tests/webhook_server.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner import cli
from runner.errors import InputError
from runner.host import status, submit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"


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


def fake_run(root: Path, name: str) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: {name}\n")
    return run


# --- the wrong run ------------------------------------------------------------------------------------------------

def test_a_run_name_resolves_to_its_newest_run_never_to_a_longer_name(tmp_path: Path) -> None:
    fake_run(tmp_path, "quickstart-big-20261124-235959")  # alphabetically last, and older
    fake_run(tmp_path, "quickstart-20261124-100000")
    newest = fake_run(tmp_path, "quickstart-20261125-000001-10")  # the tenth submit within one second
    fake_run(tmp_path, "quickstart-20261125-000001-9")
    fake_run(tmp_path, "quickstart-20261125-000001")
    assert status.find_run("quickstart", tmp_path).root == newest
    assert status.find_run("quickstart-big", tmp_path).name == "quickstart-big-20261124-235959"
    assert status.find_run("quickstart-20261124-100000", tmp_path).name == "quickstart-20261124-100000"


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
    names = sorted(r.name for r in roots)
    assert status.find_run("quickstart", tmp_path / "runs").name == max(
        names, key=lambda n: (len(n.split("-")) > 3 and int(n.split("-")[-1]), n))


def test_status_lists_the_runs_beside_an_entry_it_cannot_stat(tmp_path: Path) -> None:
    fake_run(tmp_path, "good-20261124-100000")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # ELOOP on every stat
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.yaml")  # a FIFO is no config: never opened
    out = runner("status", "--json", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert [r["run"] for r in json.loads(out.stdout)] == ["good-20261124-100000"]


def test_cli_main_does_not_raise_for_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "nope", "--root", str(tmp_path)]) == 2
    assert "found no run directory" in capsys.readouterr().err
