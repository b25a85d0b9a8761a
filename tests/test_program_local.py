"""Program mode, locally: users' own scripts (tests/programs/, no import of runner) under `runner submit` with 2
real processes, as they would run them: trained to the end, stopped by a signal and resumed, a NaN, a hang, bad
input, and a program that is not Lightning."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runner import checkpoint
from runner.rundir import EXIT_HANG, EXIT_NONFINITE, EXIT_PREFLIGHT, EXIT_PROGRAM, EXIT_REQUEUE, RunDir, read_json
from tests.conftest import fixture_tier
from tests.waiting import until

pytestmark = pytest.mark.local
PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CONF = """\
num_nodes: 1
num_device: 2
runner:
  name: pm
  scheduler: local
  container: {runtime: none}
  checkpoint: {every_n_steps: 10}
"""
TRAIN = "python train.py --devices ${num_device} --num_nodes ${num_nodes} --max_steps 80"
# For runs that get a signal: slow enough steps that it lands well before the last one (sleeping changes no number).
SLOW = TRAIN + " --stateful --sleep 0.05"


def submit(where: Path, command: str, *overrides: str, interrupt: int | None = None) -> tuple[int, str, RunDir]:
    """Write conf.yaml (running ``command``) beside the test programs (lightning_train.py as train.py) in
    ``where``, run `runner submit conf.yaml` there and return its exit code, its output and the run. ``interrupt``:
    the signal sent to `runner submit` once the run's second checkpoint (step 20) is complete."""
    shutil.copy(PROGRAMS / "lightning_train.py", where / "train.py")
    shutil.copy(PROGRAMS / "torch_train.py", where / "torch_train.py")
    (where / "conf.yaml").write_text(f"{CONF}command: {command}\n")
    proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", "conf.yaml", *overrides], cwd=where, env=ENV,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if interrupt is not None:
        def complete() -> bool:
            if list(where.glob("runs/pm-*/checkpoints/step-0000020/COMPLETE")):
                return True
            assert proc.poll() is None, "no checkpoint at step 20: the run ended"
            return False
        until("the checkpoint at step 20", complete, 120, every=0.02)
        proc.send_signal(interrupt)
    out, _ = proc.communicate(timeout=240)
    [run] = where.glob("runs/pm-*")
    return proc.returncode, out, RunDir(run)


def resume(run: RunDir) -> None:
    out = subprocess.run([sys.executable, "-m", "runner", "resume", str(run.root)], capture_output=True, text=True,
                         env=ENV, timeout=240)  # from the repository: the program still runs where it was submitted
    assert out.returncode == 0, out.stdout + out.stderr


def events(run: RunDir, name: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e["event"] == name]


def weights(run: RunDir) -> list[dict[str, torch.Tensor]]:
    files = sorted(run.final.glob("rank-*.pt"))
    assert [f.name for f in files] == ["rank-00000.pt", "rank-00001.pt"]
    return [torch.load(f, weights_only=True) for f in files]


def train_starts(run: RunDir, attempt: int) -> int:
    """The step the script itself prints at on_train_start (its ``trainer.global_step``)."""
    [step] = re.findall(r"^train starts at step (\d+)$", run.rank_log(0, attempt).read_text(), re.M)
    return int(step)


@pytest.fixture(scope="module")
@fixture_tier("local")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    code, out, run = submit(tmp_path_factory.mktemp("undisturbed"), SLOW)
    assert code == 0, out
    return run


def test_a_plain_lightning_script_trains_to_the_end_with_runners_callback(undisturbed: RunDir) -> None:
    run = undisturbed
    assert run.finished.exists() and [e["step"] for e in events(run, "finished")] == [80]
    for rank in (0, 1):
        info = read_json(run.root / "ranks" / f"rank-{rank:05d}.json")
        assert info["rank"] == rank and info["runtime"] == "none" and info["in_container"] is False
        log = run.rank_log(rank).read_text()
        assert "Adding 1 callbacks from entry point 'runner'" in log  # Lightning's own line: its factory found ours
        assert "trained to step 80" in log  # the script's code after fit ran
    assert [step for step, _ in checkpoint.complete(run.checkpoints)] == [80, 70, 60]  # keep_last 3
    assert all(checkpoint.verify(path) is None for _, path in checkpoint.complete(run.checkpoints))
    assert [e["exactness"] for e in events(run, "data")] == ["exact"]  # its StatefulDataLoader resumes mid-epoch


@pytest.mark.parametrize("sig, stateful, own_ckpt", [(signal.SIGUSR2, True, False), (signal.SIGINT, False, False),
                                                     (signal.SIGUSR2, True, True)],
                         ids=["preemption-notice", "ctrl-c-plain-loader", "program-passes-its-own-ckpt_path"])
def test_stopped_by_a_signal_the_same_script_resumes_from_its_checkpoint(tmp_path: Path, undisturbed: RunDir,
                                                                         sig: int, stateful: bool,
                                                                         own_ckpt: bool) -> None:
    """A preemption notice (USR2) or a Ctrl-C after the second checkpoint: every rank checkpoints at an agreed step
    and the run asks to be requeued; `runner resume` continues the same script from that checkpoint (the script's
    own global_step at on_train_start), bitwise equal to an undisturbed run when its loader resumes mid-epoch. A
    program that passes its own ckpt_path to fit (ESPnet3's `fit: {ckpt_path: ...}`) resumes from runner's all the
    same."""
    command = (SLOW if stateful else SLOW.replace(" --stateful", "")) + (" --ckpt_path last" if own_ckpt else "")
    code, out, run = submit(tmp_path, command, interrupt=sig)
    assert code == EXIT_REQUEUE, out
    assert not run.finished.exists() and events(run, "exit")[-1]["exit_code"] == EXIT_REQUEUE
    assert "received SIGUSR2" in run.rank_log(1, 1).read_text()  # Ctrl-C reaches the ranks as the notice
    newest, path = checkpoint.complete(run.checkpoints)[0]
    assert 20 < newest < 80  # the agreed step the signal was acted on, after the checkpoint at step 20
    if sig == signal.SIGUSR2 and not own_ckpt:  # its layout is on its command line: runner cannot keep its batch
        out = subprocess.run([sys.executable, "-m", "runner", "resume", str(run.root), "num_device=1"],
                             capture_output=True, text=True, env=ENV, timeout=60)
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "found a program that does not read ${program_config}" in out.stderr, out.stderr
    resume(run)
    assert train_starts(run, 1) == 0 and train_starts(run, 2) == newest
    start = [e for e in events(run, "train_start") if e["attempt"] == 2]
    assert [(e["step"], e["resumed_from"], e["lost_steps"]) for e in start] == [(newest, str(path), 0)]
    assert run.finished.exists() and [e["step"] for e in events(run, "finished")] == [80]
    if own_ckpt:
        assert f"step-{newest:07d} (step {newest}) instead of the program's ckpt_path last" in \
            run.rank_log(0, 2).read_text()
    exactness = {e["exactness"] for e in events(run, "data")}
    if not stateful:  # a plain DataLoader under Lightning's DistributedSampler: replayed to the stop's batch
        assert exactness == {"exact"}
        [said] = events(run, "resumed")
        assert said["data_exact"] and "the epoch's pass replayed to that batch" in said["data"], said
        return
    assert exactness == {"exact"}
    for resumed, reference in zip(weights(run), weights(undisturbed), strict=True):
        assert resumed.keys() == reference.keys()
        assert all(torch.equal(resumed[k], reference[k]) for k in resumed), "not bitwise equal"


def test_a_nan_from_the_script_stops_it_with_finite_checkpoints_only(tmp_path: Path) -> None:
    code, out, run = submit(tmp_path, TRAIN + " --nan-at 25")
    assert code == EXIT_NONFINITE, out
    assert [e["step"] for e in events(run, "nonfinite")] == [25] and not run.finished.exists()
    assert [step for step, _ in checkpoint.complete(run.checkpoints)] == [20, 10]
    written = [int(p.name.rsplit("-", 1)[1]) for p in run.checkpoints.glob("*step-*")]  # staged ones too
    assert max(written) < 25
    model = checkpoint.CheckpointDir.model(run.checkpoints / "step-0000020")
    state = torch.load(model, weights_only=False)["state_dict"]
    assert state and all(torch.isfinite(t).all() for t in state.values())


def test_a_program_that_never_reaches_a_step_is_a_hang(tmp_path: Path) -> None:
    code, out, run = submit(tmp_path, TRAIN + " --stall-at 0", "runner.watchdog.first_step_s=8")
    assert code == EXIT_HANG, out
    hang = read_json(run.root / "hang.json")
    assert hang["world"] == 2 and hang["phases"] == {"forward": 2}, hang
    assert "all 2 ranks in forward" in hang["summary"] and [e["summary"] for e in events(run, "hang")] == \
        [hang["summary"]]
    for rank in (0, 1):  # each rank says where in the script it is stuck
        report = read_json(run.root / "hangs" / "attempt-1" / f"rank-{rank:05d}.json")
        assert report["rank"] == rank and report["where"] == f"{tmp_path / 'train.py'}:training_step"


@pytest.mark.parametrize("command, reason, says", [
    ("no-such-binary --x", "not_found", "no command 'no-such-binary' on PATH"),
    (TRAIN.replace("--max_steps 80", "--max_steps 0"), "no_training", "the program exited 0 without training a step"),
    (TRAIN.replace("--devices ${num_device}", "--devices 1"), "world_size", "the program's Trainer trains 1 ranks"),
], ids=["no-command", "no-training", "world-size"])  # no script: validate refuses it (test_first_hour.py)
def test_a_program_that_cannot_train_says_why_in_one_line(tmp_path: Path, command: str, reason: str,
                                                          says: str) -> None:
    code, out, run = submit(tmp_path, command)
    assert code == EXIT_PROGRAM, out
    [line] = [line for line in out.splitlines() if " ERROR " in line]
    assert says in line and "hint: " in line and "Traceback" not in out, out
    for rank in (0, 1):  # `runner logs --rank N` says the same, whichever rank the user reads
        log = run.rank_log(rank).read_text()
        assert says in log and "Traceback" not in log, log
    assert [e["reason"] for e in events(run, "program_error")] == [reason]
    assert says in events(run, "program_error")[0]["detail"]
    assert events(run, "exit")[-1]["exit_code"] == EXIT_PROGRAM and not run.finished.exists()


MISSING = f"{sys.executable} cannot find espnet3_not_in_this_python, which run.py:2 imports: " \
    "`import espnet3_not_in_this_python.stages as stages`"


def test_a_script_whose_packages_the_ranks_python_lacks_is_refused_by_the_preflight(tmp_path: Path) -> None:
    """ESPnet3's run.py under runner's own venv (no espnet3): the preflight names the ranks' Python and refuses it in
    one line naming the package and the script's line, before any rank trains, instead of a ModuleNotFoundError on
    every rank after it; a failed preflight waits for a person (no requeue loop)."""
    (tmp_path / "run.py").write_text("import os\nimport espnet3_not_in_this_python.stages as stages\n\n"
                                     "print('trained')\n")
    code, out, run = submit(tmp_path, "python run.py --stages train")
    assert code == EXIT_PREFLIGHT, out
    assert f"preflight_failed (exit 77): preflight fail: python on {socket.gethostname()}: {MISSING} (expected the " \
        "ranks' Python finds every package the program imports)" in out.splitlines()[-2], out
    log = run.rank_log(0).read_text()
    [line] = [line for line in log.splitlines() if " ERROR " in line]
    assert f"preflight: {MISSING}; expected the ranks' Python finds every package the program imports. hint: run " \
        "the ranks with the Python that has the program's packages" in line, line
    assert "Traceback" not in out + log and "trained" not in out + log
    report = read_json(run.preflight)
    assert report["status"] == "fail" and MISSING in report["summary"], report
    [python] = [c for c in report["checks"] if c["name"] == "python"]
    assert (python["status"], python["value"]) == ("fail", MISSING)
    assert "python " in run.preflight_table.read_text()
    [end] = events(run, "exit")
    assert (end["outcome"], end["exit_code"]) == ("preflight_failed", EXIT_PREFLIGHT), end


def test_the_preflight_names_the_python_that_has_the_programs_packages(tmp_path: Path) -> None:
    code, out, run = submit(tmp_path, TRAIN.replace("--max_steps 80", "--max_steps 2"))
    assert code == 0, out
    [python] = [c for c in read_json(run.preflight)["checks"] if c["name"] == "python"]
    assert (python["status"], python["value"], python["threshold"]) == ("pass", sys.executable,
                                                                        "finds lightning, torch"), python


def test_without_a_preflight_the_lacking_package_stops_the_program_at_its_start(tmp_path: Path) -> None:
    (tmp_path / "run.py").write_text("import os\nimport espnet3_not_in_this_python.stages as stages\n")
    code, out, run = submit(tmp_path, "python run.py --stages train", "runner.preflight.enabled=false")
    assert code == EXIT_PROGRAM, out
    [line] = [line for line in out.splitlines() if " ERROR " in line]
    assert f"program: {MISSING}. hint: run the ranks with the Python" in line, line
    assert [e["reason"] for e in events(run, "program_error")] == ["missing_package"]
    assert not run.preflight.exists() and "Traceback" not in out


def test_a_plain_torch_program_finishes_at_the_last_step_runner_saw(tmp_path: Path) -> None:
    """No Trainer, no runner.progress: its optimizer steps (stephook) give the finished marker its last step and
    productive seconds (goodput), and no warning that runner saw nothing."""
    code, out, run = submit(tmp_path, "python torch_train.py")
    assert code == 0, out
    assert [(e["step"], e["lightning"]) for e in events(run, "finished")] == [(20, False)]
    done = read_json(run.finished, {})
    assert done["step"] == 20 and 0 < done["productive_s"] < 60, done
    for rank in (0, 1):
        log = run.rank_log(rank).read_text()
        assert f"rank {rank} of 2, 2 on this node" in log and "trained 20 steps" in log
        assert "saw none of its steps" not in log, log
    assert "finished at step 20, the last of the program's steps runner saw" in run.rank_log(0).read_text()
    assert not list(run.checkpoints.glob("step-*"))


def test_a_program_runner_saw_no_step_of_says_so_once_it_ends(tmp_path: Path) -> None:
    (tmp_path / "collective.py").write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())\n")
    code, out, run = submit(tmp_path, "python collective.py")
    assert code == 0, out
    assert [(e["step"], e["lightning"]) for e in events(run, "finished")] == [(None, False)]
    assert read_json(run.finished, {})["productive_s"] is None
    for rank in (0, 1):
        log = run.rank_log(rank).read_text()
        assert "sum 2.0" in log and "runner saw none of its steps" in log and "did not apply" in log, log


def test_a_program_with_its_own_fsdp_gets_sharded_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    """A Lightning program that shards its model itself (ModelParallelStrategy, fully_shard in configure_model):
    runner's callback writes its checkpoints one DCP shard per rank, and a preempted run resumes from them bitwise
    equal to an undisturbed one."""
    fsdp = SLOW + " --fsdp"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code, out, undisturbed = submit(tmp_path / "a", fsdp)
    assert code == 0, out
    code, out, run = submit(tmp_path / "b", fsdp, interrupt=signal.SIGUSR2)
    assert code == EXIT_REQUEUE, out
    newest, path = checkpoint.complete(run.checkpoints)[0]
    manifest = read_json(path / "manifest.json")
    assert manifest["format"] == "dcp" and manifest["shards"] == {"0": "__0_0.distcp", "1": "__1_0.distcp"}
    assert checkpoint.verify(path) is None and "model.ckpt" not in manifest["files"]
    resume(run)
    assert train_starts(run, 2) == newest
    for mine, ref in zip(weights(run), weights(undisturbed), strict=True):
        assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
