"""The run's one-file records (runner/records.py): one writer and one reader each, through RunDir; whatever a file
holds comes back as the type or as None, never as an exception."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from runner import records
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

RUNNER = Path(__file__).resolve().parents[1] / "runner"


@pytest.mark.parametrize(("raw", "read"), [
    # as the exit hook writes it
    ({"exit_code": 1, "job_id": "7", "attempt": 2, "signal": None, "event": "failed", "time": 5.0},
     {"exit_code": 1, "job_id": "7", "attempt": 2, "signal": None, "event": "failed", "time": 5.0}),
    # as the local driver writes it
    ({"exit_code": 75, "codes": [75, 75], "event": "preempted", "attempt": 1, "time": 3},
     {"exit_code": 75, "codes": [75, 75], "event": "preempted", "attempt": 1, "time": 3.0}),
    # a local cancel of a run none of whose processes lived: no code, the user's word
    ({"cancelled": True, "time": 9.5}, {"exit_code": None, "cancelled": True, "time": 9.5}),
    # older and hand-made shapes: what cannot be read as its type is dropped
    ({"exit_code": 1, "job_id": "100", "event": "failed"}, {"exit_code": 1, "job_id": "100", "event": "failed",
                                                           "time": 0.0}),
    ({"exit_code": 0, "time": float("nan"), "attempt": True, "codes": [0, "1"], "job_id": 5},
     {"exit_code": 0, "time": 0.0}),
    ({"exit_code": True}, None),  # a bool is no exit code
    ({"exit_code": "1"}, None),
    ({"cancelled": "yes"}, None),
    ({}, None), ([], None), (None, None), ("exit", None), (1, None),
])
def test_an_exit_status_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.exit_status(raw) == read


def test_the_run_directory_writes_and_reads_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.exit_status_record() is None
    run.write_exit_status({"exit_code": 3, "event": "failed", "time": 1.0})
    assert run.exit_status_record() == {"exit_code": 3, "event": "failed", "time": 1.0}
    run.exit_status.write_text('{"exit_code": 3, "ev')  # torn by a full disk or a crash
    assert run.exit_status_record() is None
    run.exit_status.write_text(json.dumps([{"exit_code": 3}]))
    assert run.exit_status_record() is None


def test_only_the_records_and_the_run_directory_name_the_file() -> None:
    named = [str(p.relative_to(RUNNER)) for p in sorted(RUNNER.rglob("*.py"))
             if re.search(r"""["']exit_status\.json["']""", p.read_text())]
    assert named == ["rundir.py"]
    writers = [f"{p.relative_to(RUNNER)}: {line.strip()}" for p in sorted(RUNNER.rglob("*.py")) if p.name != "rundir.py"
               for line in p.read_text().splitlines() if re.search(r"(write_text|atomic_write)\(.*exit_status\b", line)]
    assert writers == [], "exit_status.json is written through RunDir.write_exit_status"


@pytest.mark.parametrize(("raw", "read"), [
    # as the launcher (rank 0) and a hang's watchdog write it
    ({"code": 75, "job_id": "41", "time": 2.5, "restart_count": "1"},
     {"code": 75, "job_id": "41", "time": 2.5, "restart_count": "1"}),
    ({"code": 0, "job_id": None, "time": 1, "restart_count": "0"},  # a local run
     {"code": 0, "job_id": None, "time": 1.0, "restart_count": "0"}),
    # older and hand-made shapes
    ({"code": 1, "restart_count": 2}, {"code": 1, "job_id": None, "time": 0.0, "restart_count": "2"}),
    ({"code": 1, "job_id": 41, "restart_count": None}, {"code": 1, "job_id": None, "time": 0.0, "restart_count": None}),
    ({"code": "75"}, None), ({"code": False}, None), ({"job_id": "41"}, None), ([], None), (None, None),
])
def test_the_last_exit_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.last_exit(raw) == read


@pytest.mark.parametrize(("raw", "read"), [
    ({"step": 80, "code": None, "resumed": True, "time": 3.0, "productive_s": 12.5},
     {"step": 80, "code": None, "resumed": True, "time": 3.0, "productive_s": 12.5}),
    ({"step": 20, "code": 75, "resumed": False, "time": 3, "productive_s": 4},
     {"step": 20, "code": 75, "resumed": False, "time": 3.0, "productive_s": 4.0}),
    ({}, {"step": 0, "code": None, "resumed": False, "time": 0.0, "productive_s": None}),  # trained no step
    ({"step": "80", "resumed": "yes", "productive_s": float("inf")},
     {"step": 0, "code": None, "resumed": False, "time": 0.0, "productive_s": None}),
    ([{"step": 80}], None), ("x", None), (None, None),  # None: no Trainer carried runner's callback
])
def test_a_program_outcome_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.program_outcome(raw) == read


@pytest.mark.parametrize(("raw", "read"), [
    ({"attempt": 2, "job": "41", "restart": "0", "step": 20, "path": "/r/checkpoints/step-0000020"},  # an older one
     {"attempt": 2, "job": "41", "restart": "0", "step": 20, "path": "/r/checkpoints/step-0000020", "tried": 0}),
    ({"attempt": 1, "job": None, "restart": "0", "step": None, "path": None, "tried": 0},  # no checkpoint: the start
     {"attempt": 1, "job": None, "restart": "0", "step": None, "path": None, "tried": 0}),
    ({"attempt": 1, "step": 20, "tried": "1"},
     {"attempt": 1, "job": None, "restart": None, "step": None, "path": None, "tried": 0}),
    ({"attempt": 3, "job": None, "restart": "0", "step": 10, "path": "/r/checkpoints/step-0000010", "tried": 1},
     {"attempt": 3, "job": None, "restart": "0", "step": 10, "path": "/r/checkpoints/step-0000010", "tried": 1}),
    ({"attempt": 1, "path": "/r/checkpoints/step-0000020"}, None),  # a path without its step: not a verdict
    ({"attempt": "1"}, None), ({}, None), ("verdict", None),
])
def test_a_resume_verdict_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.resume_verdict(raw) == read


MANIFEST = {"step": 20, "epoch": 1, "config_hash": "abc", "world_size": 2, "time": 5.0, "runner_version": "0.1.0",
            "productive_s": 30.5, "mid_epoch": True, "epoch_batches": 12, "accumulate": 2,
            "files": {"model.ckpt": {"size": 3, "sha256": "00"}}}


@pytest.mark.parametrize(("raw", "read"), [
    (MANIFEST, MANIFEST),  # as checkpoint.publish writes it
    ({**MANIFEST, "format": "dcp", "shards": {"0": "__0_0.distcp", "1": "__1_0.distcp"}},
     {**MANIFEST, "format": "dcp", "shards": {"0": "__0_0.distcp", "1": "__1_0.distcp"}}),
    ({"step": 10, "config_hash": "h", "time": 7}, {"step": 10, "config_hash": "h", "time": 7.0}),  # an older one
    # hand-made: a field of the wrong type is dropped, the rest kept; files' entries are checkpoint.verify's to judge
    ({"step": "20", "world_size": True, "mid_epoch": 1, "time": float("nan"), "shards": {"0": 5}, "extra": 1,
      "files": {"model.ckpt": "?"}}, {"files": {"model.ckpt": "?"}}),
    (None, {}), ([MANIFEST], {}), ("manifest", {}),
])
def test_a_checkpoint_manifest_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.checkpoint_manifest(raw) == read


def test_the_run_directory_writes_and_reads_the_jobs_records(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.last_exit_record() is None and run.resume_verdict_record() is None
    assert run.program_outcome_record(1, 0) is None
    run.write_last_exit(75, "41", "1")
    assert {k: v for k, v in (run.last_exit_record() or {}).items() if k != "time"} == \
        {"code": 75, "job_id": "41", "restart_count": "1"}
    run.new_attempt()
    run.write_program_outcome(1, 3, {"step": 8, "code": None, "resumed": False, "time": 1.0, "productive_s": 2.0})
    assert run.program_outcome_record(1, 3) == {"step": 8, "code": None, "resumed": False, "time": 1.0,
                                                "productive_s": 2.0}
    run.write_resume_verdict({"attempt": 1, "job": None, "restart": "0", "step": None, "path": None, "tried": 0})
    assert run.resume_verdict_record() == {"attempt": 1, "job": None, "restart": "0", "step": None, "path": None,
                                           "tried": 0}
    run.last_exit.write_text('{"code": 7')  # torn
    assert run.last_exit_record() is None


def test_a_published_checkpoints_manifest_reads_back_as_written(tmp_path: Path) -> None:
    from runner import checkpoint

    staging = checkpoint.CheckpointDir(tmp_path).staging(20)
    staging.mkdir()
    checkpoint.CheckpointDir.model(staging).write_bytes(b"weights")
    written: Any = {k: v for k, v in MANIFEST.items() if k != "files"}
    path = checkpoint.publish(tmp_path, 20, written)
    read = checkpoint.manifest_of(path)
    assert {k: v for k, v in read.items() if k != "files"} == written and list(read.get("files", {})) == ["model.ckpt"]


RUN = {"runner_version": "0.1.0", "config_hash": "abc", "config_file": "/w/conf.yaml", "overrides": ["seed=2"],
       "scheduler": "slurm", "image": "/img/r-1.sif", "runtime": "apptainer", "spec_hash": "0123", "world_size": 4,
       "global_batch": 64, "accumulate_grad_batches": 2,
       "git": {"commit": "f00", "dirty": True, "diff_files": [".env"], "diff_sha256": "ab"}, "created": 1.5,
       "host": "login1", "data_module": {"target": "m.Data", "takes_dataloader": True, "global_batch": 64},
       "cwd": "/w"}
PARALLEL = {"runner_version": "0.1.0", "kind": "parallel", "scheduler": "local", "env": "local_gpu",
            "config_file": "/w/par.yaml", "items": 100, "created": 2.0, "host": "ws"}


@pytest.mark.parametrize(("raw", "read"), [
    (RUN, RUN),  # as runner submit writes it
    (PARALLEL, PARALLEL),  # as the runner parallel driver writes it
    # program mode, a local run outside git: the None fields are the writer's, kept
    ({**RUN, "spec_hash": None, "global_batch": None, "accumulate_grad_batches": None, "image": "none",
      "git": {"commit": None, "dirty": None, "diff_files": None, "diff_sha256": None},
      "data_module": {"target": None, "takes_dataloader": None, "global_batch": "the program's own"}},
     {**RUN, "spec_hash": None, "global_batch": None, "accumulate_grad_batches": None, "image": "none",
      "git": {"commit": None, "dirty": None, "diff_files": None, "diff_sha256": None},
      "data_module": {"target": None, "takes_dataloader": None, "global_batch": "the program's own"}}),
    # an older one: no data_module, cwd, spec_hash or runtime; an integer time
    ({"runner_version": "0.0.9", "config_hash": "h", "scheduler": "slurm", "world_size": 2, "created": 100,
      "git": {"commit": "f00", "dirty": False}},
     {"runner_version": "0.0.9", "config_hash": "h", "scheduler": "slurm", "world_size": 2, "created": 100.0,
      "git": {"commit": "f00", "dirty": False}}),
    # hand-made: a field of the wrong type is dropped (in git and data_module too), the rest kept; unknown ones go
    ({"config_hash": 7, "scheduler": ["slurm"], "world_size": True, "global_batch": "64", "created": float("nan"),
      "overrides": ["a=1", 2], "image": None, "items": 1.5, "extra": 1, "host": "login1",
      "git": {"commit": 5, "dirty": "yes", "diff_files": ".env", "diff_sha256": "ab", "diff": "secret"},
      "data_module": {"target": 3, "takes_dataloader": 1, "global_batch": 64}},
     {"host": "login1", "git": {"diff_sha256": "ab"}, "data_module": {"global_batch": 64}}),
    ({"git": "f00", "data_module": [], "overrides": "seed=2"}, {}),
    ({}, {}), (None, {}), ([RUN], {}), ("manifest", {}), (3, {}),
])
def test_a_run_manifest_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.run_manifest(raw) == read


def test_the_run_directory_writes_and_reads_its_manifest(tmp_path: Path) -> None:
    from runner.errors import RunnerError
    from runner.host import observe
    from runner.rundir import manifest_text

    run = RunDir(tmp_path)
    assert run.manifest_record() is None and observe.manifest_of(run) == {}
    written: Any = RUN
    run.write_manifest(written)
    assert run.manifest.read_text() == manifest_text(written) == json.dumps(RUN, indent=2) + "\n"
    assert run.manifest_record() == RUN and observe.manifest_of(run) == RUN
    run.manifest.write_text(json.dumps({**RUN, "world_size": "4"}))  # hand-edited: the field is dropped
    assert "world_size" not in (run.manifest_record() or {}) and "world_size" not in observe.manifest_of(run)
    for damaged in ('{"config_hash": "ab', "[]"):  # torn; not an object
        run.manifest.write_text(damaged)
        assert run.manifest_record() is None
        with pytest.raises(RunnerError) as e:  # the strict reader: one line, the run shown as broken
            observe.manifest_of(run)
        assert "manifest.json" in str(e.value) and "\n" not in str(e.value)


def test_only_the_run_directory_and_the_strict_reader_touch_the_run_manifest() -> None:
    touch = re.compile(r"(read_json|read_regular|json\.loads?|atomic_write|write_text|read_text)\(.*\b(run|rd|self)"
                       r"\.manifest\b")
    found = [f"{p.relative_to(RUNNER)}: {line.strip()}" for p in sorted(RUNNER.rglob("*.py"))
             if str(p.relative_to(RUNNER)) not in ("rundir.py", "host/observe.py")
             for line in p.read_text().splitlines() if touch.search(line.replace("p.run.", "run."))]
    assert found == [], "manifest.json is read through RunDir.manifest_record or observe.manifest_of"


HANDOFFS = [  # handoff.json as found -> what a standby task reads (None: keeps waiting)
    ({"env": {"MASTER_ADDR": "n1"}, "nodes": ["n1", "n3"], "per_node": 2},
     {"env": {"MASTER_ADDR": "n1"}, "nodes": ["n1", "n3"], "per_node": 2}),
    ({"env": {}, "nodes": [], "per_node": 1}, {"env": {}, "nodes": [], "per_node": 1}),  # stand down
    ({"env": {"A": 1}, "nodes": ["n1"], "per_node": 2}, None),
    ({"env": {}, "nodes": "n1", "per_node": 2}, None),
    ({"env": {}, "nodes": ["n1"], "per_node": 0}, None),
    ({"env": {}, "nodes": ["n1"], "per_node": True}, None),
    ({"nodes": ["n1"], "per_node": 1}, None),
    ([], None),
    (None, None),
]


@pytest.mark.parametrize(("raw", "read"), HANDOFFS)
def test_standby_handoff(raw: Any, read: Any) -> None:
    assert records.standby_handoff(raw) == read
