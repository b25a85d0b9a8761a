"""runner sweep in-process: the grid's expansion and its bad input as tables (one line, exit 2), what a sweep's driver
does with each point, the job array's tasks, and `runner status`'s grouping (processes: tests/test_sweep_local.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner import cli, records, spec
from runner.errors import ConfigError
from runner.host import render, sweep

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"


@pytest.mark.parametrize(("text", "values"), [
    ("1,2,3", ["1", "2", "3"]),
    ("0.01", ["0.01"]),
    (" a , b ", ["a", "b"]),
    ("[1,2],[3,4]", ["[1,2]", "[3,4]"]),
    ('"a,b",c', ['"a,b"', "c"]),
    ("'x,y'", ["'x,y'"]),
    ("{a: 1, b: 2},{a: 3}", ["{a: 1, b: 2}", "{a: 3}"]),
    ("1,,2", ["1", "", "2"]),
    ("", [""]),
])
def test_values_split_at_commas_outside_brackets_and_quotes(text: str, values: list[str]) -> None:
    assert sweep.split_values(text) == values


@pytest.mark.parametrize(("axes", "points"), [
    (["a=1,2"], [(("a", "1"),), (("a", "2"),)]),
    (["a=1,2", "b=x,y,z"], [(("a", "1"), ("b", "x")), (("a", "1"), ("b", "y")), (("a", "1"), ("b", "z")),
                            (("a", "2"), ("b", "x")), (("a", "2"), ("b", "y")), (("a", "2"), ("b", "z"))]),
    (["a=1,2", "c=5"], [(("a", "1"), ("c", "5")), (("a", "2"), ("c", "5"))]),
    (["m.lr=[1,2],[3]"], [(("m.lr", "[1,2]"),), (("m.lr", "[3]"),)]),
])
def test_the_grid_is_every_combination_first_key_slowest(axes: list[str], points: list[sweep.Point]) -> None:
    assert sweep.expand(axes) == points


def test_explicit_points_each_take_every_grid_combination() -> None:
    explicit = [(("x", "1"), ("y", "2")), (("x", "3"),)]
    assert sweep.expand(["z=a,b"], explicit) == [
        (("x", "1"), ("y", "2"), ("z", "a")), (("x", "1"), ("y", "2"), ("z", "b")),
        (("x", "3"), ("z", "a")), (("x", "3"), ("z", "b"))]
    assert sweep.expand([], explicit) == explicit


def test_a_points_file_is_a_list_of_mappings_read_as_overrides(tmp_path: Path) -> None:
    f = tmp_path / "points.yaml"
    f.write_text("- {model.lr: 0.1, trainer.max_steps: 5}\n- model: {lr: 1.0e-3}\n  name: '7'\n"
                 "- {x: [1, 2], y: null}\n")
    assert sweep.read_points(f) == [(("model.lr", "0.1"), ("trainer.max_steps", "5")),
                                    (("model.lr", "0.001"), ("name", "'7'")),
                                    (("x", "[1, 2]"), ("y", "null"))]
    data: dict[str, Any] = {"model": {"lr": 0}, "name": "q"}
    spec.apply_overrides(data, sweep.overrides(sweep.read_points(f)[1]))
    assert data == {"model": {"lr": 0.001}, "name": "7"}  # the string '7' stays a string


@pytest.mark.parametrize(("args", "said"), [
    (["model.lr"], "sweep 'model.lr': found no '='; expected key.path=v1,v2,... hint: model.lr=0.01,0.1"),
    (["=1,2"], "sweep '=1,2': found no key before '='; expected key.path=v1,v2,..."),
    (["model.lr="], "sweep model.lr: found an empty value (value 1 of 1 in 'model.lr='); expected a value between "
                    "every two commas. hint: model.lr=1,2"),
    (["model.lr=0.1,,1"], "sweep model.lr: found an empty value (value 2 of 3 in 'model.lr=0.1,,1'); expected a "
                          "value between every two commas. hint: model.lr=0.1,1"),
    (["model.lr=0.1,"], "found an empty value (value 2 of 2"),
    (["model.lr=1,2", "model.lr=3"], "sweep model.lr: found it twice ('model.lr=1,2' and 'model.lr=3'); expected "
                                     "each key once. hint: one list, model.lr=v1,v2,..."),
    (["model.lr=1,1"], "sweep model.lr: found the value '1' twice; expected each value once"),
    ([], "runner sweep: found no values to sweep; expected key.path=v1,v2,... or --points FILE"),
    (["trainer.foo=1,2"], "trainer.foo: found 'foo'; expected a known key"),  # validate refuses it: so does sweep
    (["trainer.max_steps=5,abc"], "sweep point 1 (trainer.max_steps=abc): "),  # one point's problem names it
    (["run_root=/tmp/a,/tmp/b"], "sweep point 1 (run_root=/tmp/b): found run_root /tmp/b, point 0 /tmp/a; "
                                 "expected one run_root for the whole sweep"),
    (["--parallel", "0", "model.lr=1,2"], "--parallel 0: found a number below 1"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sweep", "--dry-run", str(QUICKSTART), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("runner: error: ") and said in err, err
    assert "Traceback" not in err


def test_validate_and_sweep_say_the_same_for_every_point(capsys: pytest.CaptureFixture[str]) -> None:
    """A problem every point has is said as `runner validate` (and submit) says it, not once per point."""
    assert cli.main(["validate", str(QUICKSTART), "trainer.foo=1"]) == 2
    validate_err = capsys.readouterr().err
    assert cli.main(["sweep", "--dry-run", str(QUICKSTART), "trainer.foo=1", "model.lr=0.1,0.2"]) == 2
    assert capsys.readouterr().err == validate_err


@pytest.mark.parametrize(("text", "said"), [
    ("", "found no points; expected a YAML list of points"),
    ("{a: 1}", "found dict; expected a YAML list of points"),
    ("- 3\n", "point 1: found int; expected a YAML list of points"),
    ("- {}\n", "point 1: found nothing; expected"),
    ("- {a: 1}\n- {model: {lr: 1}, model.lr: 2}\n", "point 2: found model.lr twice; expected each key once in a point"),
])
def test_a_bad_points_file_is_one_line(text: str, said: str, tmp_path: Path) -> None:
    f = tmp_path / "points.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        sweep.read_points(f)
    assert len(e.value.problems) == 1 and said in e.value.problems[0]


def test_a_key_in_the_points_file_and_the_grid_or_a_point_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="found it in point 1 of the points file and in 'a=1,2'"):
        sweep.expand(["a=1,2"], [(("a", "3"),)])
    with pytest.raises(ConfigError, match=r"found point 1 \(a=1\) twice"):
        sweep.expand([], [(("a", "1"),), (("a", "1"),)])
    monkeypatch.setattr(sweep, "MAX_POINTS", 10)
    with pytest.raises(ConfigError, match="found 12 points; expected at most 10"):
        sweep.expand(["a=1,2,3", "b=1,2,3,4"])


def test_the_keys_shown_are_those_that_vary() -> None:
    assert sweep.varied(sweep.expand(["a=1,2", "b=x", "c=3,4"])) == ["a", "c"]
    assert sweep.varied([(("a", "1"),), (("a", "1"), ("b", "2"))]) == ["b"]  # missing from one point: it varies


@pytest.mark.parametrize(("facts", "what"), [
    # written, finished, held, cancelled, started
    ((False, False, False, False, False), "plan"),  # the first driver died before it wrote the point
    ((True, True, False, False, True), "done"),  # completed: never run again
    ((True, False, True, False, True), "busy"),  # its own driver still runs it
    ((True, False, False, True, True), "done"),  # a person cancelled it: their word holds
    ((True, False, False, False, False), "start"),  # written, never started
    ((True, False, False, False, True), "resume"),  # failed, interrupted, killed with its driver
])
def test_a_resumed_sweep_runs_only_what_is_not_finished(facts: tuple[bool, bool, bool, bool, bool],
                                                        what: str) -> None:
    assert sweep.action(*facts)[0] == what


def test_the_job_array_maps_task_i_to_point_is_run_directory() -> None:
    cfgs = [spec.load(QUICKSTART, ["scheduler=slurm", f"model.lr={lr}"]) for lr in (0.1, 0.2, 0.3)]
    runs = [Path(f"/r/runs/quickstart-20260101-000000{s}") for s in ("", "-2", "-3")]
    text = render.array(cfgs, "sweep-q-1", Path("/r/runs/sweeps/sweep-q-1"), runs, limit=2)
    assert "#SBATCH --array=0-2%2\n" in text
    assert "#SBATCH --output=/r/runs/sweeps/sweep-q-1/slurm-%A_%a.out\n" in text
    listed = text.split("RUN_DIRS=(\n", 1)[1].split("\n)", 1)[0].split()
    assert listed == [str(r) for r in runs]  # bash arrays count from 0, as Slurm's task ids do
    own = render.sbatch(cfgs[0], runs[0], "none")
    header = [line for line in own.splitlines() if line.startswith("#SBATCH") and "--output" not in line]
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")][:len(header)] == header


def test_a_job_array_of_points_that_ask_slurm_for_different_things_is_refused() -> None:
    cfgs = [spec.load(QUICKSTART, ["scheduler=slurm", f"num_nodes={n}"]) for n in (1, 2)]
    with pytest.raises(ConfigError, match="point 1 asks Slurm for --nodes=2, point 0 for --nodes=1"):
        render.array(cfgs, "s", Path("/r/s"), [Path("/r/a"), Path("/r/b")], 2)


def test_a_manifest_keeps_a_whole_sweep_mark_only() -> None:
    mark = {"id": "sweep-q-1", "index": 2, "size": 6, "point": {"model.lr": "0.1"}}
    assert records.run_manifest({"sweep": mark}) == {"sweep": mark}
    for bad in ({**mark, "index": "2"}, {**mark, "index": True}, {**mark, "point": {"a": 1}}, "sweep-q-1", None):
        assert "sweep" not in records.run_manifest({"sweep": bad})


def _row(name: str, state: str, sweep_id: str | None = None, index: int = 0, point: dict[str, str] | None = None,
         ) -> dict[str, Any]:
    r: dict[str, Any] = {"run": name, "state": state, "job_id": None, "last_checkpoint_step": None, "restarts": 0,
                         "lost_steps": [], "goodput": None, "last_outcome": None, "age_s": 5.0}
    if sweep_id:
        r["sweep"] = {"id": sweep_id, "index": index, "size": 3, "point": point or {}}
    return r


def test_status_groups_a_sweeps_runs_under_one_line_at_its_first_runs_place() -> None:
    rows = [_row("alone-1", "completed"), _row("q-b", "running", "sweep-q", 1, {"lr": "0.2"}),
            _row("q-a", "completed", "sweep-q", 0, {"lr": "0.1"}), _row("alone-2", "failed"),
            _row("q-c", "completed", "sweep-q", 2, {"lr": "0.3"})]
    lines = sweep.table(rows).splitlines()
    assert lines[0].startswith("RUN ")
    assert lines[1].startswith("alone-1 ")
    assert lines[2] == "sweep sweep-q: 3 of 3 runs, 2 completed, 1 running"
    assert [line.split()[:3] for line in lines[3:6]] == [["q-a", "lr=0.1", "completed"], ["q-b", "lr=0.2", "running"],
                                                         ["q-c", "lr=0.3", "completed"]]
    assert all(line.startswith("  ") for line in lines[3:6]) and lines[6].startswith("alone-2 ")
    plain = [_row("a", "completed"), _row("b", "failed")]
    from runner.host import status

    assert sweep.table(plain) == status.table(plain)
