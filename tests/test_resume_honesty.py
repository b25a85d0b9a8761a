"""The honesty record of a resume (ledger ``resumed``): what is exact and what is not, for each kind of resume, as a
table (``honesty.resumed`` is pure; the end-to-end resumes in test_fsdp_local/test_fsdp_cluster assert the record
their runs wrote)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runner import checkpoint
from runner.job import honesty
from runner.rundir import RunDir

pytestmark = pytest.mark.unit


def manifest(world: int, step: int = 13, batches: int | None = 10, acc: int | None = 2, mid: bool = True) -> dict:
    m: dict[str, Any] = {"step": step, "epoch": 0, "world_size": world, "mid_epoch": mid}
    if batches is not None:
        m.update(epoch_batches=batches, accumulate=acc)
    return m


# (manifest, world, accumulate, sharded, exact_resume, loader resumable) ->
#   (state, bitwise, data_exact, first step's samples)
CASES = [
    pytest.param(manifest(2), 2, 2, True, True, True, ("exact", True, True, None), id="fsdp-same-shape"),
    pytest.param(manifest(2), 2, 2, False, True, True, ("exact", True, True, None), id="ddp-same-shape"),
    pytest.param(manifest(2), 1, 4, True, True, True, ("resharded", False, False, 16), id="fsdp-2-to-1-mid-accum"),
    pytest.param(manifest(4, batches=8, acc=1), 2, 2, True, True, True, ("resharded", False, False, None),
                 id="fsdp-4-to-2-on-a-step"),
    pytest.param(manifest(2, batches=32, mid=False), 1, 4, True, True, True, ("resharded", False, True, None),
                 id="fsdp-2-to-1-epoch-end"),
    pytest.param(manifest(2), 1, 4, False, True, True, ("exact", False, False, 16), id="ddp-2-to-1"),
    pytest.param(manifest(2), 2, 2, False, False, True, ("exact", False, True, None), id="exact-resume-off"),
    pytest.param(manifest(2), 2, 2, False, True, False, ("exact", False, False, None), id="plain-dataloader"),
    pytest.param(manifest(2, batches=None), 1, 4, True, True, True, ("resharded", False, False, None),
                 id="manifest-before-the-fields"),
]


@pytest.mark.parametrize(("m", "world", "acc", "sharded", "exact_resume", "loader", "expected"), CASES)
def test_what_a_resume_keeps_exactly(m: dict, world: int, acc: int, sharded: bool, exact_resume: bool, loader: bool,
                                     expected: tuple) -> None:
    r = honesty.resumed(m, world, acc, 32, sharded=sharded, exact_resume=exact_resume, loader_resumable=loader)
    assert (r.state, r.trajectory == honesty.BITWISE, r.data_exact, r.first_step_samples) == expected, r
    assert (r.step, r.from_world, r.to_world, r.to_accumulate) == (13, m["world_size"], world, acc)
    assert r.samples == 13 * 32 and r.global_batch == 32  # the global sample count at the checkpoint
    assert r.reshaped == (world != m["world_size"]) and r.fields()["reshaped"] == r.reshaped
    assert "\n" not in r.data and r.data.startswith("step 13 (416 samples at global batch 32), epoch 0")
    if r.reshaped:
        assert r.trajectory.startswith(f"not bitwise: {world} ranks sum the gradients in another order than "
                                       f"{m['world_size']}")
    if r.reshaped and m["mid_epoch"] and m.get("epoch_batches"):
        assert f"{m['epoch_batches']} batches per rank into the epoch kept as a count" in r.data


def test_a_global_data_position_moved_onto_another_world_size_is_exact() -> None:
    """24 batches per rank on 2 ranks = 48 of all ranks: 48 per rank on 1 (the loader said it is a global position,
    and the count was moved with it), on an accumulation boundary of the new shape."""
    r = honesty.resumed(manifest(2, batches=24), 1, 4, 32, sharded=True, exact_resume=True, loader_resumable=True,
                        global_position=(48, 24, 48))
    assert r.data_exact and r.epoch_batches == 24 and r.epoch_batches_now == 48 and r.first_step_samples is None
    assert "48 batches of all ranks into the epoch, kept as a global position (24 per rank on 2 ranks, 48 per rank " \
           "on 1)" in r.data
    assert r.trajectory.startswith("not bitwise")  # the same samples, summed in another order


def progress(ready: int, total: int) -> dict[str, Any]:
    """Lightning's batch progress as a checkpoint holds it after a batch's end (completed one behind)."""
    return {"total": {"ready": total, "completed": total - 1, "started": total, "processed": total},
            "current": {"ready": ready, "completed": ready - 1, "started": ready, "processed": ready},
            "is_last_batch": False}


def lightning_ckpt(loader: dict[str, Any], ready: int = 24) -> dict[str, Any]:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": [loader]},
                                   "epoch_loop.batch_progress": progress(ready, 100 + ready)}}}


@pytest.mark.parametrize(("loader", "world", "moved"), [
    ({"epoch": 0, "consumed": 24, "global_batches": 48, "world_size": 2}, 1, (48, 24, 48)),
    ({"epoch": 0, "consumed": 24, "global_batches": 48, "world_size": 2}, 4, (48, 24, 12)),
    ({"epoch": 0, "consumed": 24, "global_batches": 48, "world_size": 2}, 2, None),  # same world: nothing to move
    ({"epoch": 0, "consumed": 24, "global_batches": 48, "world_size": 2}, 5, None),  # 48 batches do not split in 5
    ({"epoch": 0, "consumed": 24}, 1, None),  # a per-rank position (the shard rotation): kept as a count
    ({"epoch": 0, "consumed": 24, "global_batches": 50, "world_size": 2}, 1, None),  # disagrees with Lightning's
], ids=["2-to-1", "2-to-4", "same", "indivisible", "per-rank", "inconsistent"])
def test_lightnings_count_moves_only_with_a_global_position(loader: dict, world: int, moved: tuple | None) -> None:
    from runner.job import internals

    ckpt = lightning_ckpt(loader)
    assert internals.move_epoch_position(ckpt, world) == moved
    now = moved[2] if moved else 24
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"] == progress(now, 100 + now)


def test_a_programs_resume_has_no_global_batch_of_runners() -> None:
    r = honesty.resumed(manifest(2), 2, 2, None, sharded=True, exact_resume=True, loader_resumable=True)
    assert r.global_batch is None and r.samples is None and r.first_step_samples is None
    assert r.data.startswith("step 13, epoch 0, 10 batches per rank into the epoch: the same samples")


def assert_resumed_honestly(rd: RunDir, ckpt: dict[str, Any], to_world: int, to_accumulate: int, state: str,
                            epoch_len: int = 32, global_position: bool = False) -> None:
    """The ``resumed`` record of a resume onto another world size says what was exact and what not, and the data
    position it kept (the step, so the global sample count, and the position in the epoch) is where the run's next
    checkpoint counted on from: no batch of the epoch taken again or skipped. ``ckpt``: the manifest of the
    checkpoint resumed from; ``epoch_len``: batches per rank and epoch on the new shape (the quickstart's 1024
    samples / 4 shards / batch 8: one shard per rank and epoch on any shape); ``global_position``: the loader's
    position is a global one (example ``order=global``), moved onto the new world size."""
    [r] = [e for e in rd.events() if e["event"] == "resumed"]
    assert (r["from_world"], r["to_world"], r["from_accumulate"], r["to_accumulate"]) == \
        (ckpt["world_size"], to_world, ckpt["accumulate"], to_accumulate) and r["reshaped"]
    assert r["state"] == state and r["trajectory"].startswith("not bitwise: ")
    assert (r["step"], r["epoch"], r["epoch_batches"], r["mid_epoch"]) == \
        (ckpt["step"], ckpt["epoch"], ckpt["epoch_batches"], ckpt["mid_epoch"])
    assert r["global_batch"] == 32 and r["samples"] == ckpt["step"] * 32
    assert r["data_exact"] == (not ckpt["mid_epoch"] or global_position)
    start = r["epoch_batches_now"]  # each new rank's count into the epoch: moved with a global position, else kept
    assert start == (ckpt["epoch_batches"] * ckpt["world_size"] // to_world if global_position else
                     ckpt["epoch_batches"])
    cut = start % to_accumulate if ckpt["mid_epoch"] else 0
    assert r["first_step_samples"] == (32 // to_accumulate * (to_accumulate - cut) if cut else None)
    # Lightning's count on the new shape goes on from there: a step every `to_accumulate` batches of the epoch and
    # at its end (the first one shorter when the checkpoint fell inside an accumulation).
    manifests = [json.loads((p / "manifest.json").read_text()) for _, p in checkpoint.complete(rd.checkpoints)]
    after = min((m for m in manifests if m["world_size"] == to_world), key=lambda m: m["step"])
    step, epoch, batches = ckpt["step"], ckpt["epoch"], start
    while step < after["step"]:
        if batches == epoch_len:
            epoch, batches = epoch + 1, 0
        batches += 1
        step += batches % to_accumulate == 0 or batches == epoch_len
    assert (after["epoch"], after["epoch_batches"]) == (epoch, batches), (ckpt, after)


def test_a_loader_replayed_to_the_stops_batch_is_the_same_samples_bitwise() -> None:
    r = honesty.resumed(manifest(2), 2, 2, 32, sharded=False, exact_resume=True, loader_resumable=True, replayed=True)
    assert r.data_exact and r.trajectory == honesty.BITWISE
    assert r.data.endswith("10 batches per rank into the epoch: the same samples (the epoch's pass replayed to that "
                           "batch: its batches before it read again, not trained)")


def test_a_loader_that_cannot_be_positioned_says_what_lightnings_count_trains() -> None:
    """Lightning counts on from the checkpoint's batch while the loader starts its pass again (a resume on another
    world size of a loader runner replays only on its own): what that epoch trains, in words."""
    r = honesty.resumed(manifest(2), 1, 4, 32, sharded=False, exact_resume=True, loader_resumable=False)
    assert not r.data_exact and "it replays the epoch from its start while Lightning counts on from batch 10" in r.data


def test_a_resume_that_passed_over_a_mid_epoch_checkpoint_goes_back_to_the_epochs_start() -> None:
    r = honesty.resumed(manifest(2, step=16, batches=16, mid=False), 2, 2, 32, sharded=False, exact_resume=True,
                        loader_resumable=False, passed_over=21)
    assert r.data_exact and r.trajectory == honesty.BITWISE and r.step == 16
    assert "the newer checkpoint of step 21, mid-epoch, was passed over" in r.data and "(5 steps again)" in r.data


# (the checkpoint's manifest, the resume's world size) -> passed over for the newest checkpoint at an epoch's end
PASSES_OVER = [
    pytest.param({"mid_epoch": True, "position": "replayed", "world_size": 4}, 4, False, id="replayed-same-layout"),
    pytest.param({"mid_epoch": True, "position": "replayed", "world_size": 4}, 2, True, id="replayed-other-layout"),
    pytest.param({"mid_epoch": True, "position": "replayed", "world_size": 4}, None, False,
                 id="replayed-world-unknown"),
    pytest.param({"mid_epoch": True, "position": "replayed"}, 2, False, id="replayed-writer-unknown"),
    pytest.param({"mid_epoch": False, "position": "replayed", "world_size": 4}, 2, False, id="replayed-epoch-end"),
    pytest.param({"mid_epoch": True, "position": "restored", "world_size": 4}, 2, False, id="restored-other-layout"),
    pytest.param({"mid_epoch": True, "position": "epoch start", "world_size": 4}, 4, True, id="epoch-start"),
    pytest.param({"mid_epoch": False, "position": "epoch start", "world_size": 4}, 4, False, id="epoch-start-end"),
    pytest.param({}, 2, False, id="no-manifest"),
]


@pytest.mark.parametrize(("m", "world", "passed"), PASSES_OVER)
def test_which_checkpoints_a_resume_passes_over_for_the_epochs_start(m: dict, world: int | None, passed: bool) -> None:
    """A loader replayed to its batch is replayed on the layout that wrote the checkpoint only: on another world size
    each rank's share of the epoch is other samples, so the resume goes back to the epoch's start (decided here, where
    the resume's checkpoint is chosen: ``checkpoint.latest(positioned=True, world=...)``)."""
    assert checkpoint.passes_over(m, world) is passed


# (resumed from, world, loader resumable, replayed, passed over, layout bound) -> (partial_epoch, steps_again, says)
PARTIAL = [
    pytest.param(manifest(4, step=16, batches=4, acc=1, mid=False), 2, False, False, 21, True,
                 ("restarted", 5, "the newer checkpoint of step 21, mid-epoch, was passed over: the loader is replayed "
                  "to a batch only on the layout that wrote it (4 ranks), not on 2, so the interrupted epoch is "
                  "trained again from its start, each batch once (5 steps again)"), id="replayed-other-layout"),
    pytest.param(manifest(2, step=16, batches=16, mid=False), 2, False, False, 21, False,
                 ("restarted", 5, "the loader cannot be positioned mid-epoch, so the interrupted epoch is trained "
                  "again"), id="not-positionable"),
    pytest.param(manifest(2, step=16, batches=16, mid=False), 1, False, False, None, False,
                 ("whole", None, "at the epoch's end: the next epoch starts whole"), id="epoch-end"),
    pytest.param(manifest(2), 2, True, True, None, False, ("exact", None, "the epoch's pass replayed to that batch"),
                 id="replayed-same-layout"),
    pytest.param(manifest(2), 1, True, False, None, False, ("counted", None, "kept as a count"), id="restored-other"),
    pytest.param(manifest(2), 1, False, False, None, False,
                 ("twice and never", None, "those before that batch a second time) and never as many of its last"),
                 id="not-positionable-mid"),
]


@pytest.mark.parametrize(("m", "world", "resumable", "replayed", "passed_over", "bound", "expected"), PARTIAL)
def test_what_becomes_of_the_interrupted_epoch(m: dict, world: int, resumable: bool, replayed: bool,
                                               passed_over: int | None, bound: bool, expected: tuple) -> None:
    r = honesty.resumed(m, world, 2, 32, sharded=False, exact_resume=True, loader_resumable=resumable,
                        replayed=replayed, passed_over=passed_over, layout_bound=bound)
    partial, again, says = expected
    assert (r.partial_epoch, r.steps_again) == (partial, again) and says in r.data, r
    assert r.fields()["partial_epoch"] == partial
