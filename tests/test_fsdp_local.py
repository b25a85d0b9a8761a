"""trainer.strategy: fsdp on CPU, end to end: 2 local processes (gloo), the model really sharded (FSDP2 through
Lightning's ModelParallelStrategy), one DCP shard per rank in each checkpoint, resumed bitwise on the same shape
and resharded on another."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from runner import checkpoint
from runner.rundir import EXIT_HANG, RunDir
from tests import slow_disk
from tests.conftest import fixture_tier
from tests.test_local_run import QUICKSTART, SLOW, STEPS, assert_bitwise, runner, start, wait_for
from tests.test_resume_honesty import assert_resumed_honestly
from tests.waiting import until

pytestmark = pytest.mark.local
FSDP = ("trainer.strategy=fsdp",)


def final(run: Path) -> list[dict[str, torch.Tensor]]:
    """Each rank's final shards (rank r's local part of every parameter)."""
    assert (run / "finished").exists()
    return [torch.load(f, weights_only=True) for f in sorted((run / "final").glob("rank-*.pt"))]


@pytest.fixture(scope="module")
@fixture_tier("local")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """An uninterrupted fsdp run: its checkpoints' layout, and the shards every interrupted run must end with."""
    root = tmp_path_factory.mktemp("fsdp-reference")
    runner("submit", str(QUICKSTART), f"run_root={root}", f"trainer.max_steps={STEPS}", *FSDP)
    [run] = root.glob("quickstart-*")
    return run, final(run)


def test_fsdp_trains_on_cpu_with_the_model_sharded_and_one_shard_file_per_rank(reference: tuple) -> None:
    run, shards = reference
    # Really sharded: each rank holds about half of the model's parameter elements (FSDP2 splits every parameter
    # on its first dimension; a 1-row layer leaves its one row to rank 0).
    held = [json.loads((run / "ranks" / f"params-rank{r:05d}.json").read_text()) for r in (0, 1)]
    total = held[0]["model"]
    assert sum(h["resident"] for h in held) == total
    assert all(0.4 * total <= h["resident"] <= 0.6 * total for h in held), held
    # The final shards of the two ranks differ (they are different parts of the model), and add up to it.
    assert sum(t.numel() for s in shards for t in s.values()) == total
    assert any(not torch.equal(a, shards[1][k]) for k, a in shards[0].items())
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-0000020", "step-0000030", "step-0000040"]  # keep_last 3
    for path in ckpts:
        names = sorted(p.name for p in path.iterdir())
        assert names == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "manifest.json", "meta.pt",
                         "rng-rank00000.pt", "rng-rank00001.pt"], names
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["format"] == "dcp" and manifest["world_size"] == 2
        assert manifest["shards"] == {"0": "__0_0.distcp", "1": "__1_0.distcp"}
        assert "model.ckpt" not in manifest["files"] and set(manifest["files"]) == set(names) - {"COMPLETE",
                                                                                               "manifest.json"}
        assert checkpoint.verify(path) is None
    assert checkpoint.latest(run / "checkpoints", check=True) == (40, ckpts[-1])
    log = RunDir(run).rank_log(0).read_text()
    assert "fsdp: 1 sharded units (net)" in log and "holds" in log


def test_a_damaged_shard_is_never_resumed_from(tmp_path: Path, reference: tuple) -> None:
    """The manifest's sha256 of each rank's shard is checked on resume, as model.ckpt's is for DDP."""
    run, _ = reference
    copy = tmp_path / "ckpts"
    subprocess.run(["cp", "-a", str(run / "checkpoints"), str(copy)], check=True)
    with open(copy / "step-0000040" / "__1_0.distcp", "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    assert checkpoint.verify(copy / "step-0000040") == "__1_0.distcp does not match its manifest (size or sha256)"
    assert checkpoint.latest(copy, check=True) == (30, copy / "step-0000030")
    manifest = json.loads((copy / "step-0000030" / "manifest.json").read_text())
    manifest["shards"].pop("1")
    (copy / "step-0000030" / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(copy / "step-0000030") == "manifest lists 1 shards for world size 2"


def test_usr2_then_resume_is_bitwise_equal_to_the_undisturbed_run(tmp_path: Path, reference: tuple) -> None:
    proc, run = start(tmp_path, *FSDP, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out
    stopped = json.loads(runner("status", str(run), "--json").stdout)[0]
    assert stopped["state"] == "preempted" and 10 <= stopped["last_checkpoint_step"] < STEPS
    runner("resume", str(run))
    assert_bitwise(final(run), reference[1])
    for rank in (0, 1):
        assert "resuming from" in RunDir(run).rank_log(rank).read_text()


def test_a_verified_checkpoint_that_fails_to_load_is_skipped_for_the_previous_one(tmp_path: Path,
                                                                                 reference: tuple) -> None:
    """The newest checkpoint's two shard files swapped, and their digests in its manifest: it verifies, yet DCP
    reads rank 1's data as rank 0's and every rank's load fails (it crashed every resume). The ranks agree, the
    checkpoint is marked and recorded, and the same resume goes on from the previous complete one to the end, bitwise
    as the undisturbed run; no later resume tries it again."""
    proc, run = start(tmp_path, *FSDP, SLOW)
    wait_for(run / "checkpoints" / "step-0000020" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, out
    [(newest, swapped), (previous, kept)] = checkpoint.complete(run / "checkpoints")[:2]
    first, second = swapped / "__0_0.distcp", swapped / "__1_0.distcp"
    first.rename(swapped / "swap")
    second.rename(first)
    (swapped / "swap").rename(second)
    manifest = json.loads((swapped / "manifest.json").read_text())
    files = manifest["files"]
    files[first.name], files[second.name] = files[second.name], files[first.name]
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(swapped) is None  # its files match its manifest
    runner("resume", str(run), timeout=240)
    assert_bitwise(final(run), reference[1])
    rd = RunDir(run)
    [skipped] = [e for e in rd.events() if e["event"] == "checkpoint_unloadable"]
    assert (skipped["step"], skipped["path"]) == (newest, str(swapped)) and skipped["why"].startswith("rank "), skipped
    start_2 = [e for e in rd.events() if e["event"] == "train_start" and e["attempt"] == 2]
    assert [(e["step"], e["resumed_from"]) for e in start_2] == [(previous, str(kept))]  # one start: no loop
    for rank in (0, 1):
        assert f"checkpoint {swapped} (step {newest}) verified but failed to load" in rd.rank_log(rank).read_text()
    assert checkpoint.verify(swapped) == f"it failed to load before ({skipped['why']})"  # never tried again


def test_resume_on_another_world_size_reshards_and_keeps_the_global_batch(tmp_path: Path) -> None:
    """2 ranks -> 1: DCP loads the two shards into one rank. The run continues from the checkpoint's step with the
    global batch kept (accumulation 2 -> 4), its loss where it was; not bitwise equal to a 2-rank run (another
    sum order, another data split and dropout stream), which nothing here claims."""
    proc, run = start(tmp_path, *FSDP, SLOW)
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    proc.communicate(timeout=180)
    [(step, path)] = checkpoint.complete(run / "checkpoints")[:1]
    stopped_at = json.loads((path / "manifest.json").read_text())  # pruned by the resumed run's checkpoints
    out = runner("resume", str(run), "num_device=1", timeout=240)
    assert "resized from 1x2 (accumulate 2) to 1x1 (accumulate 4); global batch 32 kept" in out.stdout
    assert (run / "finished").exists()
    rd = RunDir(run)
    log = rd.rank_log(0).read_text()
    assert f"resuming from {run / 'checkpoints' / f'step-{step:07d}'} (step {step})" in log
    starts = [e for e in rd.events() if e["event"] == "train_start"]
    assert starts[-1]["step"] == step  # continued where the checkpoint was, no step lost or repeated
    held = json.loads((run / "ranks" / "params-rank00000.json").read_text())
    assert held["world_size"] == 1 and held["resident"] == held["model"]  # one rank holds it all
    [w] = final(run)
    assert all(torch.isfinite(t).all() for t in w.values())
    newest = checkpoint.complete(run / "checkpoints")[0][1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["shards"] == {"0": "__0_0.distcp"}
    losses = [float(line.split(" loss ")[1].split()[0]) for line in log.splitlines()
              if ": step " in line and " loss " in line]
    assert losses and all(loss < 5.0 for loss in losses), log  # trained on, not restarted from scratch
    assert_resumed_honestly(rd, stopped_at, to_world=1, to_accumulate=4, state="resharded")



def test_a_kill_during_the_sharded_write_keeps_the_previous_checkpoint(tmp_path: Path, reference: tuple) -> None:
    with mock.patch.dict(os.environ, slow_disk.env(20, 60)):  # step 20's shards land, then its publication waits
        proc, run = start(tmp_path, *FSDP)
    ckpts = run / "checkpoints"
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank00001.pt"):
        wait_for(ckpts / ".staging-step-0000020" / name)
    subprocess.run(["pkill", "-KILL", "-f", f"runner.job.launch {run}"], check=False)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-0000010"]
    assert checkpoint.latest(ckpts, check=True) == (10, ckpts / "step-0000010")
    runner("resume", str(run))
    assert_bitwise(final(run), reference[1])
    for rank in (0, 1):
        assert f"resuming from {ckpts / 'step-0000010'} (step 10)" in RunDir(run).rank_log(rank).read_text()
    assert not list(ckpts.glob(".staging-*"))


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    out = runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=20", *FSDP,
                 "model.faults.nan_at_step=7", "model.faults.rank=1", "model.lr=0.005", "checkpoint.every_n_steps=5",
                 check=False, timeout=240)
    [run] = tmp_path.glob("quickstart-*")
    rd = RunDir(run)
    events = [(e["event"], e["step"]) for e in rd.events() if e["event"].startswith("nonfinite")]
    assert events == [("nonfinite", 7)], out.stdout + out.stderr
    assert not (run / "finished").exists()
    for rank in (0, 1):
        assert "at step 7: training stops" in rd.rank_log(rank).read_text()
    assert json.loads(rd.last_exit.read_text())["code"] == 80
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*"))] == ["step-0000005"]  # none of the NaN


def test_a_slow_fsdp_rank_is_a_straggler_and_stopped_it_is_named_as_the_hang(tmp_path: Path) -> None:
    """The guards on shards, as under DDP: FSDP2 all-gathers inside the forward, yet the slow rank is the one named
    (its own forward time against the median), and a SIGSTOPped rank is named, with its node, by the others'
    watchdogs, which exit with the hang code. (Of two ranks the median is their mean: a straggler is one more than 3x
    slower than the other, so the slow rank sleeps 0.3 s a step against the other's 0.05 s.)"""
    proc, run = start(tmp_path, *FSDP, SLOW, "trainer.max_steps=100000", "model.faults.slow_s=0.3",
                      "model.faults.rank=1", "watchdog.straggler_report_s=1", "watchdog.floor_s=3")
    rd = RunDir(run)
    rank1: dict[str, Any] = {}
    try:
        wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE", 180)
        def straggler() -> bool:
            if any(e["event"] == "straggler" for e in rd.events()):
                return True
            assert proc.poll() is None, "no straggler record: the run ended"
            return False
        until("a straggler record", straggler, 120, every=0.2)
        rank1 = json.loads((run / "ranks" / "rank-00001.json").read_text())
        os.kill(rank1["pid"], signal.SIGSTOP)
        wait_for(run / "hang.json", 120)
    finally:
        if rank1:
            os.kill(rank1["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    [slow] = [e for e in rd.events() if e["event"] == "straggler"]
    assert (slow["rank"], slow["node"], slow["slow"]) == (1, rank1["hostname"], "forward"), slow
    assert slow["compute_x"] > 1.5
    table = runner("status", str(run), "--ranks").stdout.splitlines()
    assert table[1].split()[:2] == ["1", rank1["hostname"]] and table[1].rstrip().endswith("forward"), table
    hang = json.loads((run / "hang.json").read_text())
    assert [(s["rank"], s["node"], s["state"]) for s in hang["suspects"]] == \
        [(1, rank1["hostname"], "not responding")], hang
    assert f"rank 1 on {rank1['hostname']}" in hang["summary"]
    assert json.loads(rd.last_exit.read_text())["code"] == EXIT_HANG, out
    [event] = [e for e in rd.events() if e["event"] == "hang"]
    assert event["summary"] == hang["summary"]


def test_a_global_data_position_goes_on_exactly_on_another_world_size(tmp_path: Path) -> None:
    """The example loader in one global order (``data.order=global``: an epoch is one seeded order of all samples,
    the ranks take its batches in turn) saves a global position; stopped on 2 ranks mid-epoch and resumed on 1, the
    run takes the rest of the epoch's batches: every batch of each epoch trained once, by the 2 ranks before the
    stop and the 1 rank after it, and the record says the position is exact."""
    trace = tmp_path / "trace"
    proc, run = start(tmp_path, *FSDP, SLOW, "trainer.max_steps=64", "data.order=global", f"data.trace_dir={trace}")
    wait_for(run / "checkpoints" / "step-0000010" / "COMPLETE")
    proc.send_signal(signal.SIGUSR2)
    proc.communicate(timeout=180)
    [(step, path)] = checkpoint.complete(run / "checkpoints")[:1]
    stopped_at = json.loads((path / "manifest.json").read_text())
    assert stopped_at["mid_epoch"] and step < 32, stopped_at  # in the first epoch: 128 batches = 32 steps of 4
    runner("resume", str(run), "num_device=1", timeout=300)
    assert (run / "finished").exists()
    rd = RunDir(run)
    assert_resumed_honestly(rd, stopped_at, to_world=1, to_accumulate=4, state="resharded", epoch_len=128,
                            global_position=True)
    taken = [tuple(int(x) for x in line.split()) for f in sorted(trace.glob("rank-*.txt"))
             for line in f.read_text().splitlines()]
    assert sorted(b for e, b in taken if e == 0) == list(range(128))  # the interrupted epoch: each batch once
    assert sorted(b for e, b in taken if e == 1) == list(range(128))  # and the next one, whole, on 1 rank
    log = rd.rank_log(0).read_text()
    done = stopped_at["epoch_batches"] * 2
    assert f"data position: {done} batches of all ranks into the epoch, {done // 2} per rank on the checkpoint's " \
           f"world size, {done} per rank on this one" in log
