"""The quickstart end to end: real 2-process Lightning DDP on CPU (gloo), stopped and resumed exactly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from runner import checkpoint
from runner.rundir import RunDir
from tests import slow_disk
from tests.conftest import fixture_tier
from tests.test_resume_honesty import assert_resumed_honestly
from tests.waiting import until

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
pytestmark = pytest.mark.local
STEPS = 40
# For runs that get a signal: the ranks agree on stopping every ~0.1 s, so with 50 ms steps the signal lands well
# before the last step (with 2 ms steps the run may reach its end first, and then rightly finishes instead of
# asking for a requeue). Sleeping changes no number: the weights are those of the reference run.
SLOW = "model.step_time_s=0.05"


def runner(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def start(root: Path, *overrides: str) -> tuple[subprocess.Popen[str], Path]:
    """Start a local run in the background and return it with its run directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", str(QUICKSTART), f"run_root={root}",
                             f"trainer.max_steps={STEPS}", *overrides], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    runs = until(f"a run directory to appear in {root}", lambda: list(root.glob("quickstart-*")), 60)
    return proc, runs[0]


def wait_for(path: Path, timeout: float = 120) -> None:
    until(f"{path} to appear", path.exists, timeout, every=0.02)


def weights(run: Path) -> list[dict[str, torch.Tensor]]:
    files = sorted((run / "final").glob("rank-*.pt"))
    assert len(files) == 2
    return [torch.load(f, weights_only=True) for f in files]


def assert_bitwise(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for wa, wb in zip(a, b, strict=True):
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
@fixture_tier("local")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    """An uninterrupted run: the weights every interrupted run must end with, bit for bit."""
    root = tmp_path_factory.mktemp("reference")
    runner("submit", str(QUICKSTART), f"run_root={root}", f"trainer.max_steps={STEPS}")
    [run] = root.glob("quickstart-*")
    assert (run / "finished").exists()
    w = weights(run)
    for key in w[0]:
        assert torch.equal(w[0][key], w[1][key])  # DDP keeps every rank identical
    status = json.loads(runner("status", "--root", str(root), "--json").stdout)
    assert status[0]["state"] == "completed" and status[0]["last_checkpoint_step"] == STEPS
    ranks = sorted(json.loads(p.read_text())["rank"] for p in (run / "ranks").glob("*.json"))
    assert ranks == [0, 1]
    assert RunDir(run).attempts() == [1]
    assert [p.name for p in sorted(RunDir(run).rank_log(0).parent.glob("rank-*.log"))] == ["rank-00000.log",
                                                                                           "rank-00001.log"]
    return w


def test_signal_checkpoint_then_resume_is_bitwise_identical(tmp_path: Path, reference: list) -> None:
    proc, run = start(tmp_path, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)  # what the batch script forwards before the time limit
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out  # checkpointed, asks to be requeued
    assert not (run / "finished").exists()
    stopped = json.loads(runner("status", str(run), "--json").stdout)[0]
    assert stopped["state"] == "preempted" and 10 <= stopped["last_checkpoint_step"] < STEPS
    runner("resume", str(run))
    assert (run / "finished").exists()
    assert_bitwise(weights(run), reference)
    assert "resuming from" in RunDir(run).rank_log(1).read_text()


def test_a_signal_while_the_ranks_start_stops_them_at_their_first_step(tmp_path: Path) -> None:
    """The requeue signal as the attempt begins, before the ranks have their handlers (SIGUSR2's default kills):
    written down, read by each rank once its handlers are in place; they stop with a checkpoint, none dies."""
    proc, run = start(tmp_path, SLOW)
    wait_for(RunDir(run).attempt_logs(1))  # the driver claimed the attempt: its ranks are being started
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert (RunDir(run).pending_signal(1)).read_text() == "USR2\n"
    for rank in (0, 1):
        assert "received SIGUSR2" in RunDir(run).rank_log(rank, 1).read_text()
    stopped = json.loads(runner("status", str(run), "--json").stdout)[0]
    assert stopped["state"] == "preempted"


def test_kill_and_torn_checkpoints_are_never_used(tmp_path: Path, reference: list) -> None:
    proc, run = start(tmp_path, "checkpoint.every_n_steps=5")
    ckpts = run / "checkpoints"
    wait_for(ckpts / "step-0000015" / "COMPLETE")
    subprocess.run(["pkill", "-KILL", "-f", f"runner.job.launch {run}"], check=False)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    # Torn writes as a crash would leave them: a staging dir, a published dir whose COMPLETE never landed,
    # and a checkpoint written by another config.
    newest = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*") if (p / "COMPLETE").exists())
    # A complete checkpoint damaged afterwards (bad copy, full disk): its sha256 no longer matches.
    damaged = ckpts / f"step-{newest:07d}"
    with open(damaged / "model.ckpt", "r+b") as f:
        f.truncate(1000)
    previous = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*") if p != damaged)
    (ckpts / f".staging-step-{newest + 1:07d}").mkdir()
    torn = ckpts / f"step-{newest + 2:07d}"
    torn.mkdir()
    (torn / "model.ckpt").write_bytes(b"\0" * 100)
    alien = ckpts / f"step-{newest + 3:07d}"
    alien.mkdir()
    (alien / "manifest.json").write_text(json.dumps({"config_hash": "another-config"}))
    (alien / "COMPLETE").write_text("x")
    out = runner("resume", str(run))
    log = RunDir(run).rank_log(0).read_text()
    assert f"resuming from {ckpts / f'step-{previous:07d}'}" in log
    assert f"skipping {torn}: no COMPLETE marker" in log and "another-config" in log
    assert f"skipping {damaged}: model.ckpt does not match its manifest" in log
    assert (run / "finished").exists(), out.stdout
    assert_bitwise(weights(run), reference)


def test_resume_on_other_capacity_keeps_the_global_batch(tmp_path: Path) -> None:
    proc, run = start(tmp_path, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    proc.communicate(timeout=120)
    bad = runner("resume", str(run), "seed=3", check=False)
    assert bad.returncode == 1 and "expected only num_nodes or num_device" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    [(_, path)] = checkpoint.complete(run / "checkpoints")[:1]
    stopped_at = json.loads((path / "manifest.json").read_text())
    out = runner("resume", str(run), "num_device=1")
    assert "resized from 1x2 (accumulate 2) to 1x1 (accumulate 4); global batch 32 kept" in out.stdout
    assert (run / "finished").exists()
    resized = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines() if '"resized"' in x]
    assert resized[0]["world_size"] == 1 and resized[0]["accumulate"] == 4
    assert "resuming from" in RunDir(run).rank_log(0).read_text()
    # what the resume kept, said in its `resumed` record (fsdp's is the same but for `resharded`)
    assert_resumed_honestly(RunDir(run), stopped_at, to_world=1, to_accumulate=4, state="exact")


def test_each_attempt_logs_into_its_own_folder(tmp_path: Path) -> None:
    """Stopped and resumed: two attempts, two log folders; `runner logs` shows the latest unless asked."""
    proc, run = start(tmp_path, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75 and f"logs in {run}/logs/attempt-1/" in out, out
    runner("resume", str(run))
    rd = RunDir(run)
    assert rd.attempts() == [1, 2]
    for attempt in (1, 2):
        assert sorted(p.name for p in rd.attempt_logs(attempt).iterdir()) == ["rank-00000.log", "rank-00001.log"]
    first, second = rd.rank_log(0, 1).read_text(), rd.rank_log(0, 2).read_text()
    assert "received SIGUSR2" in first and "resuming from" not in first
    assert "resuming from" in second and "received" not in second
    assert "reused from the preflight" in second and "reused from" not in first  # same node and image, seconds later
    # one rendezvous and one process group per attempt: Lightning finds the preflight's and keeps it (its own
    # init would log "Initializing distributed"), measured or reused
    assert all("training in the preflight's process group (gloo, 2 ranks)" in log and "Initializing distributed"
               not in log for log in (first, second))
    assert runner("logs", str(run), "--attempt", "1").stdout == first
    assert runner("logs", str(run)).stdout == second
    assert runner("logs", str(run), "--rank", "1", "--attempt", "1").stdout == rd.rank_log(1, 1).read_text()
    assert [e["attempt"] for e in rd.events() if e["event"] == "train_start"] == [1, 2]
    assert json.loads((run / "ranks" / "rank-00001.json").read_text())["attempt"] == 2
    # the launcher's lines in a rank log carry their time and module
    for what in ("rank 0/2", "received SIGUSR2", "checkpoint step-0000010 complete", "stopped on signal at step"):
        [line] = [line for line in first.splitlines() if what in line]
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d INFO runner\.job\.(launch|callback): ", line), line


def final_run(root: Path) -> Path:
    [run] = root.glob("quickstart-*")
    assert (run / "finished").exists()
    return run


def all_weights(run: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=True) for f in sorted((run / "final").glob("rank-*.pt"))]


def uninterrupted_and_resumed(tmp_path: Path, overrides: list[str]) -> tuple[list[dict[str, torch.Tensor]],
                                                                            list[dict[str, torch.Tensor]]]:
    """Every rank's final weights of an uninterrupted run, and of one stopped by SIGUSR2 after its checkpoint at
    step 10 (exit 75) and resumed."""
    runner("submit", str(QUICKSTART), f"run_root={tmp_path / 'ref'}", f"trainer.max_steps={STEPS}", *overrides)
    reference = all_weights(final_run(tmp_path / "ref"))
    proc, run = start(tmp_path / "int", *overrides, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    runner("resume", str(run))
    return reference, all_weights(final_run(tmp_path / "int"))


@pytest.mark.parametrize("setting, exact", [
    ("checkpoint.exact_resume=true", True),
    ("checkpoint.exact_resume=false", False),  # shows the test can tell
    # what exact resume falls back to on a torch without the private DDP parts runner's fixed buckets use
    ("trainer.strategy=ddp_find_unused_parameters_true", True),
])
def test_four_ranks_resume_bitwise_only_with_a_fixed_bucket_layout(tmp_path: Path, setting: str, exact: bool) -> None:
    """With four ranks a ring all-reduce adds the ranks in an order that depends on DDP's bucket layout: a resume
    is bitwise exact only when the layout does not change after the restore (exact_resume's fixed buckets, or
    find_unused_parameters, with which DDP never rebuilds them)."""
    four = ["num_device=4", "preflight.enabled=false", setting]
    reference, resumed = uninterrupted_and_resumed(tmp_path, four)
    assert len(resumed) == len(reference) == 4
    same = all(torch.equal(a[k], b[k]) for a, b in zip(resumed, reference, strict=True) for k in a)
    assert same is exact


def test_exact_resume_falls_back_to_find_unused_parameters_on_a_torch_without_the_private_parts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from runner.job import internals

    assert internals.fixed_buckets_missing(DistributedDataParallel, torch.distributed.Reducer) == []  # this torch
    assert internals.fixed_buckets_missing(object, None) == [
        "DistributedDataParallel._build_params_for_reducer", "Reducer._push_all_rebuilt_params",
        "Reducer._rebuild_buckets"]
    assert type(internals.strategy("ddp", True, 60)).__name__ == "FixedBucketsDDP"
    monkeypatch.setattr(internals, "fixed_buckets_missing", lambda ddp, reducer: ["Reducer._rebuild_buckets"])
    fallback = internals.strategy("ddp", True, 60)
    assert type(fallback).__name__ == "DDPStrategy" and fallback._ddp_kwargs == {"find_unused_parameters": True}


ZEROING = """
from runner.dev.example import TinyRegressor


class Zeroing(TinyRegressor):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)
"""


def test_a_module_that_keeps_zeroed_gradients_resumes_bitwise_on_three_ranks(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """runner's DDP makes the gradients views into its buckets, except for a module that zeroes them itself: a
    kept gradient then enters the reducer as ``x / 3`` at every step, and a resumed process's first, fresh one as
    ``x * (1 / 3)``, an ulp apart (exact for 2 and 4 ranks, which is why this test needs three)."""
    (tmp_path / "zeroing.py").write_text(ZEROING)
    three = ["num_device=3", "global_batch_size=24", "dataloader.train.total_shards=3",
             "dataloader.valid.total_shards=3", "preflight.enabled=false", "model._target_=zeroing.Zeroing"]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # the CLI reads it
    reference, resumed = uninterrupted_and_resumed(tmp_path, three)
    assert len(resumed) == len(reference) == 3
    assert_bitwise(resumed, reference)


def test_kill_during_background_write_keeps_the_previous_checkpoint(tmp_path: Path, reference: list) -> None:
    """Checkpoints are written in the background; a kill mid-write leaves the previous one the newest complete
    one, and the resume (verified by rank 0 alone, the others take its verdict) ends bitwise equal."""
    with mock.patch.dict(os.environ, slow_disk.env(20, 60)):  # step 20's files land, then its publication waits
        proc, run = start(tmp_path)
    ckpts = run / "checkpoints"
    wait_for(ckpts / ".staging-step-0000020" / "model.ckpt")
    wait_for(ckpts / ".staging-step-0000020" / "rng-rank00001.pt")
    subprocess.run(["pkill", "-KILL", "-f", f"runner.job.launch {run}"], check=False)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-0000010"]
    assert (ckpts / "step-0000010" / "COMPLETE").exists()
    runner("resume", str(run))
    assert_bitwise(weights(run), reference)
    rd = RunDir(run)
    for rank in (0, 1):
        assert f"resuming from {ckpts / 'step-0000010'} (step 10)" in rd.rank_log(rank).read_text()
    assert not list(ckpts.glob(".staging-*"))


def test_a_resume_from_a_checkpoint_at_the_last_step_finishes(tmp_path: Path) -> None:
    """A time limit's checkpoint can land on the last step: the next attempt has nothing left to train, and still
    writes the final weights and the `finished` marker (it once crashed there, before any training hook ran)."""
    runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=20", "checkpoint.every_n_steps=10")
    run = final_run(tmp_path)
    before = json.loads((run / "finished").read_text())
    (run / "finished").unlink()  # as if the attempt had stopped right after its checkpoint at step 20
    shutil.rmtree(run / "final")
    out = runner("resume", str(run))
    after = json.loads((final_run(tmp_path) / "finished").read_text())
    assert after["step"] == 20, out.stdout + out.stderr
    assert after["productive_s"] >= before["productive_s"] * 0.5  # the checkpoint's training time is kept
    assert len(list((run / "final").glob("rank-*.pt"))) == 2


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_a_nan_on_one_rank_is_one_decision_on_every_rank(tmp_path: Path, action: str) -> None:
    """A NaN on rank 1 alone, with two micro-batches a step: the averaged gradients carry it to rank 0 too, so both
    ranks skip the same step (and stay identical) or both stop (no rank left waiting for the other)."""
    out = runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=20", "global_batch_size=32",
                 "dataloader.train.batch_size=8", "model.faults.nan_at_step=7", "model.faults.rank=1",
                 "model.lr=0.005", f"nonfinite.action={action}", check=False, timeout=240)
    [run] = tmp_path.glob("quickstart-*")
    events = [e for e in RunDir(run).events() if e["event"].startswith("nonfinite")]
    if action == "stop":
        assert [(e["event"], e["step"]) for e in events] == [("nonfinite", 7)], out.stdout + out.stderr
        assert not (run / "finished").exists()
        assert "non-finite gradients at step 7" in RunDir(run).rank_log(0).read_text()  # rank 0's loss was fine
        assert "non-finite loss nan at step 7" in RunDir(run).rank_log(1).read_text()
        return
    assert [(e["event"], e["step"]) for e in events] == [("nonfinite_skipped", 7)], out.stdout + out.stderr
    w = weights(run)
    for key in w[0]:
        assert torch.isfinite(w[0][key]).all() and torch.equal(w[0][key], w[1][key]), key
