"""Nothing lost, nothing leaked, never stuck: the second hostile round (issue 30).

Each section is one bullet of the issue's "Why"; every test failed on the code before its fix. Real parts only: real
run directories, real FIFOs, a real HTTP server (``tests/webhook_server.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from runner import cli
from runner.host import status

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"


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


def test_cli_main_does_not_raise_for_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "nope", "--root", str(tmp_path)]) == 2
    assert "found no run directory" in capsys.readouterr().err


# --- configs that validate, then crash every rank ----------------------------------------------------------------

def problems_of(*overrides: str, text: str | None = None, tmp_path: Path) -> list[str]:
    from runner import spec
    from runner.errors import ConfigError

    path = tmp_path / "conf.yaml"
    path.write_text(text if text is not None else QUICKSTART.read_text())
    with pytest.raises(ConfigError) as err:
        spec.load(path, list(overrides))
    for line in err.value.problems:
        assert "\n" not in line
    return err.value.problems


@pytest.mark.parametrize(("override", "key", "expected"), [
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps", "an integer from 1"),
    ("trainer.log_every_n_steps=-3", "trainer.log_every_n_steps", "an integer from 1"),
    ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch", "an integer from 1"),
    (f"network.pg_timeout_s={2 ** 63 - 1}", "network.pg_timeout_s", f"a value <= {2 ** 31 - 1}"),
    ("slurm.time='0'", "slurm.time", "at least 1 minute"),
    ("slurm.time=0:30", "slurm.time", "at least 1 minute"),
    ("slurm.time=0-0", "slurm.time", "at least 1 minute"),
    ("watchdog.floor_s=1e300", "watchdog.floor_s", "a value <= 2147483647"),
    ("preflight.probe_mib=1099511627776", "preflight.probe_mib", "a value <= 2147483647"),
    ("alerts.timeout_s=1e12", "alerts.timeout_s", "a value <= 2147483647"),
    ("checkpoint.every_n_steps=9999999999999", "checkpoint.every_n_steps", "a value <= 2147483647"),
])
def test_a_number_the_job_would_trip_over_is_refused_at_validate(tmp_path: Path, override: str, key: str,
                                                                 expected: str) -> None:
    found = [p for p in problems_of(override, tmp_path=tmp_path) if f": {key}: " in p]
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("override", ["slurm.time=1", "slurm.time=0:01:00", "slurm.time=1-0",
                                      "network.pg_timeout_s=2147483647", "trainer.log_every_n_steps=1"])
def test_the_smallest_and_largest_good_numbers_pass(tmp_path: Path, override: str) -> None:
    from runner import spec

    path = tmp_path / "conf.yaml"
    path.write_text(QUICKSTART.read_text())
    spec.load(path, [override])


@pytest.mark.parametrize("name", ["EXECIGNORE", "PYTHONHOME", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONINSPECT",
                                  "LD_PRELOAD", "LD_LIBRARY_PATH", "BASH_COMPAT", "BASH_XTRACEFD", "POSIXLY_CORRECT",
                                  "GCONV_PATH", "FUNCNEST"])
def test_env_refuses_what_changes_how_the_script_or_its_python_runs(tmp_path: Path, name: str) -> None:
    found = [p for p in problems_of(f"env.{name}=x", tmp_path=tmp_path) if f": env.{name}: " in p]
    assert len(found) == 1 and "does not change how the batch script or its Python run" in found[0], found


def test_env_keeps_the_harmless_python_switches(tmp_path: Path) -> None:
    from runner import spec

    path = tmp_path / "conf.yaml"
    path.write_text(QUICKSTART.read_text())
    spec.load(path, ["env.PYTHONUNBUFFERED=1", "env.PYTHONHASHSEED=0", "env.PYTHONFAULTHANDLER=1"])
    assert [p for p in problems_of("env.PYTHONHASHSEED=abc", tmp_path=tmp_path) if "PYTHONHASHSEED" in p]


# --- one-line errors instead of tracebacks and hangs ---------------------------------------------------------------

def test_a_lone_surrogate_is_refused_at_validate_and_submit_leaves_no_run(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    conf = tmp_path / "conf.yaml"  # YAML's own escape makes the lone surrogate: "\udcff" in double quotes
    conf.write_text(QUICKSTART.read_text() + 'env: {TOKEN: "a\\udcffb"}\nstats: {"\\udcfe": 1}\n')
    for cmd in (["validate"], ["submit"], ["submit", "--dry-run"]):
        assert cli.main([*cmd, str(conf), f"run_root={runs}"]) == 2
        err = capsys.readouterr().err
        assert "env.TOKEN" in err and "UTF-8" in err and "a key that is UTF-8 text" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 2
    assert cli.main(["validate", str(QUICKSTART), "env.TOKEN=a\udcffb"]) == 2  # the command line: refused too
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not runs.exists()


def test_an_override_key_thousands_of_levels_deep_is_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(QUICKSTART), ".".join(["a"] * 5000) + "=1"]) == 2
    err = capsys.readouterr().err
    assert "levels deep" in err and len(err.strip().splitlines()) == 1


def test_a_path_component_over_255_bytes_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = tmp_path / ("r" * 300)
    for cmd in (["validate"], ["submit", "--dry-run"]):
        assert cli.main([*cmd, str(QUICKSTART), f"run_root={long}/x"]) == 2
        err = capsys.readouterr().err
        assert "run_root" in err and "at most 255 bytes" in err and "Traceback" not in err
    assert cli.main(["validate", str(tmp_path / ("c" * 300 + ".yaml"))]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_a_huge_config_is_refused_from_its_size_before_it_is_read(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that take no disk, and would take the memory if read
    assert cli.main(["validate", str(big)]) == 2
    err = capsys.readouterr().err
    assert f"found {3 << 30} bytes" in err and len(err.strip().splitlines()) == 1


def test_a_plain_config_of_60000_keys_is_refused_for_its_size_not_for_aliases(tmp_path: Path) -> None:
    text = QUICKSTART.read_text() + "extra:\n" + "".join(f"  k{i}: {i}\n" for i in range(60_000))
    (line,) = problems_of(text=text, tmp_path=tmp_path)
    assert "found more than 100000 keys and values" in line and "aliases" not in line


# --- container.code stays inside the project ----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["entry", "inside", "file"])
def test_container_code_that_leads_outside_the_project_through_a_symlink_is_refused(tmp_path: Path, how: str) -> None:
    from runner import spec
    from runner.errors import ConfigError

    project, secret = tmp_path / "project", tmp_path / "home" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "id_rsa").write_text("PRIVATE KEY\n")
    (project / "mycode").mkdir(parents=True)
    (project / "mycode" / "train.py").write_text("x = 1\n")
    if how == "entry":
        (project / "linked").symlink_to(secret)
        entry = "linked"
    elif how == "inside":
        (project / "mycode" / "keys").symlink_to(secret)
        entry = "mycode"
    else:
        (project / "mycode" / "id_rsa").symlink_to(secret / "id_rsa")
        entry = "mycode"
    conf = project / "conf.yaml"
    conf.write_text(QUICKSTART.read_text())
    with pytest.raises(ConfigError) as err:
        spec.load(conf, [f"container.code=[runner, {entry}]", "container.runtime=podman", "scheduler=slurm"])
    (line,) = [p for p in err.value.problems if "container.code[1]" in p]
    assert "leads outside it" in line
    (project / "mycode" / "inner").symlink_to(project / "mycode")  # a link inside the project is fine
    if how == "entry":
        spec.load(conf, ["container.code=[runner, mycode]", "container.runtime=podman", "scheduler=slurm"])


@pytest.mark.parametrize("image", ["../../..", ".", "/", "images/.."])
def test_container_image_that_names_no_file_is_one_line_at_build_dry_run(tmp_path: Path, image: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["build", "--dry-run", str(QUICKSTART), f"container.image={image}",
                     "container.runtime=apptainer"]) == 2
    err = capsys.readouterr().err
    assert "container.image" in err and "the path of an image file" in err and "Traceback" not in err


# --- a webhook that accepts and never answers never stalls cron --------------------------------------------------

def test_the_sender_stops_at_its_budget_and_leaves_the_rest_queued(tmp_path: Path, webhook: Any) -> None:
    from runner import alerts

    section = {"enabled": True, "kind": "json", "url_env": "RUNNER_TEST_HOOK", "url_file": None,
               "events": ["failed"], "timeout_s": 1, "retries": 0, "backoff_s": 0}
    os.environ["RUNNER_TEST_HOOK"] = webhook.url
    try:
        dirs = [tmp_path / f"r{i}" for i in range(3)]
        for d in dirs:
            with alerts.deferred():
                assert alerts.send(alerts.Alert(event="failed", run=d.name, run_dir=str(d)), section, d) is False
        assert alerts.flush_many([(d, section) for d in dirs], budget_s=0) == (0, 3)
        assert webhook.requests == []
        assert alerts.flush_many([(d, section) for d in dirs], budget_s=30) == (3, 0)
        assert len(webhook.requests) == 3
    finally:
        del os.environ["RUNNER_TEST_HOOK"]


# --- valid JSON of the wrong shape, and special files, in a run directory ---------------------------------------

def test_a_ledger_with_bytes_that_are_not_utf8_is_read(tmp_path: Path) -> None:
    from runner.rundir import RunDir

    run = RunDir(tmp_path)
    run.record("start", job_id="1")
    with open(run.ledger, "ab") as f:
        f.write(b'{"time": 2, "event": "exit", "cause": "\xff\xfe"}\n')
    run.record("finished")
    assert [e["event"] for e in run.events()] == ["start", "exit", "finished"]
