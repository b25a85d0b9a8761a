"""Every private part of torch and Lightning that runner uses, in one file.

An image with another torch or Lightning breaks here, nowhere else: the checkpoint snapshot (Lightning's checkpoint
connector), DDP with one bucket layout for the whole run (torch's reducer), and the test for whether this torch has
what that DDP needs (``fixed_buckets_missing``), which makes exact resume fall back to a public option instead; the
non-finite guard's fused norm and sparse values; the timeout of a process group that already exists; sharded
training (``trainer.strategy: fsdp``): Lightning's ModelParallelStrategy with runner's default sharding, the
sharded checkpoint snapshot (Lightning's checkpoint connector again) and its DCP write; where that connector reads
and applies a checkpoint (``watch_restore``: one that fails to load is skipped, ``runner.job.fallback``). The
frames of torch's own code that tell the hang watchdog what a stuck rank waits in are the watchdog's
(``runner.job.watchdog``, which a plain program starts without Lightning). Where a resumed epoch continues
(Lightning's loop and fetcher state: a checkpoint after an epoch's end or its validation, a loader replayed to a
stop's batch, the next epoch's pass made once the RNG is restored). tests/test_internals.py and
tests/test_data_position.py check each against the installed torch and Lightning.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def snapshot(trainer: Any, buffers: list[Any]) -> dict[str, Any] | None:
    """Rank 0: the full Lightning checkpoint as CPU copies that later steps cannot change. Every rank builds it,
    as ``Trainer.save_checkpoint`` does, for callbacks that synchronize in ``on_save_checkpoint``.

    The copies go into the previous checkpoint's ``buffers`` where shapes and types match (its write has ended
    by then): copying 400 MB into memory already in use took 29 ms, into fresh memory 190 ms (page faults)."""
    ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    if trainer.global_rank != 0:
        return None
    old, new = iter(list(buffers)), list[Any]()

    def copy(t: Any) -> Any:
        t, into = t.detach(), next(old, None)
        if into is not None and into.shape == t.shape and into.dtype == t.dtype and into.stride() == t.stride():
            new.append(into.copy_(t))
        else:
            new.append(t.to("cpu", copy=True))
        return new[-1]

    snap = apply_to_collection(ckpt, torch.Tensor, copy)
    buffers[:] = new
    return cast(dict[str, Any], snap)


def sparse_values(t: Any) -> Any:
    """A sparse tensor's stored values (an ``nn.Embedding(sparse=True)``'s gradient)."""
    return t._values()


def norms(tensors: list[Any]) -> list[Any]:
    """The norm of each tensor, in one fused call."""
    return list(torch._foreach_norm(tensors))


def set_pg_timeout(seconds: int) -> None:
    """The default process group's timeout, after it was built (the preflight's short one gives way to training's)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def fixed_buckets_missing(ddp: Any, reducer: Any) -> list[str]:
    """The private parts of torch's DDP (its class, its C++ reducer) that the fixed-bucket DDP overrides or calls
    and this torch lacks: an image whose torch renamed them trains with ``find_unused_parameters`` instead of
    failing at setup."""
    uses = ((ddp, "DistributedDataParallel._build_params_for_reducer"),
            (reducer, "Reducer._push_all_rebuilt_params"), (reducer, "Reducer._rebuild_buckets"))
    return [what for owner, what in uses if not hasattr(owner, what.split(".")[1])]


def _missing() -> list[str]:
    missing = fixed_buckets_missing(DistributedDataParallel, getattr(torch.distributed, "Reducer", None))
    if missing:
        log.warning("this torch %s lacks DDP's %s: exact resume falls back to find_unused_parameters=True (the "
                    "same bitwise resume, an autograd-graph walk every step)", torch.__version__, ", ".join(missing))
    return missing


def strategy(name: str, exact_resume: bool, timeout_s: int, world: int = 1,
             blocks: list[str] | None = None) -> Any:
    """runner's own mode: the Lightning strategy object for ``trainer.strategy``."""
    timeout = timedelta(seconds=timeout_s)
    if name == "fsdp":
        return sharded_strategy(world, blocks or [], timeout_s)
    if name == "ddp_find_unused_parameters_true":  # the layout is never rebuilt in this mode
        return DDPStrategy(find_unused_parameters=True, timeout=timeout)
    if not exact_resume:
        return DDPStrategy(timeout=timeout)
    if _missing():
        return DDPStrategy(find_unused_parameters=True, timeout=timeout)
    return FixedBucketsDDP(timeout=timeout)


def fix_bucket_layout(strategy: Any) -> str | None:
    """Program mode: give the program's own plain DDP strategy the fixed bucket layout, in place, before it wraps
    the model (the callback's ``setup`` hook runs before ``strategy.setup``). Returns what was done, or None when
    the strategy is not plain ``DDPStrategy`` (a subclass, FSDP, find_unused_parameters) and is left as it is."""
    if type(strategy) is not DDPStrategy or strategy._ddp_kwargs.get("find_unused_parameters"):
        return None
    if _missing():
        strategy._ddp_kwargs["find_unused_parameters"] = True
        return "find_unused_parameters=True"
    strategy.__class__ = FixedBucketsDDP  # adds two methods, no state
    return "fixed bucket layout"


class ReadyOrderDDP(DistributedDataParallel):
    """DDP that numbers the parameters last to first, the order their gradients are (roughly) ready in."""

    def _build_params_for_reducer(self) -> tuple[list[Any], list[bool]]:
        params, sparse = super()._build_params_for_reducer()  # type: ignore[no-untyped-call]
        return params[::-1], sparse[::-1]


class FixedBucketsDDP(DDPStrategy):
    """DDP whose gradient buckets have the same layout at every step of every process.

    Plain DDP starts each process with all gradients in one bucket and, after the process's first backward,
    rebuilds its buckets in the order the gradients became ready (``Reducer::rebuild_buckets``). A resumed
    process's first step therefore all-reduces in another layout than the uninterrupted run did at that step,
    and with more than two ranks a ring all-reduce then adds the ranks' values in another order: the weights
    drift by an ulp. Here the rebuild happens once, at wrapping time, in the order the reducer numbers the
    parameters (``_push_all_rebuilt_params``, what DDP's join hook does), so there is nothing left to restore.
    That order is last to first (``ReadyOrderDDP``): the first bucket holds the last layers, whose gradients
    are ready first, so its all-reduce overlaps the rest of the backward as in plain DDP. In the model's own
    order the first bucket held the first layer, ready last, and nothing was sent before the backward ended
    (measured: a 50M-parameter MLP's step 5% slower). Cheaper than ``find_unused_parameters=True`` (an
    autograd-graph walk every step), which was the earlier fix.

    The gradients are views into the buckets (``gradient_as_bucket_view``): after the all-reduce nothing is
    copied back into separate gradient tensors (measured: the 50M-parameter MLP's step 8% faster, 340 ->
    311 ms, and one gradient-sized buffer less in memory). Exact resume holds because Lightning sets the
    gradients to None between steps, so every step, a resumed one included, enters the reducer the same way.
    A module that zeroes them itself (its own ``optimizer_zero_grad``, or manual optimization) would enter
    it another way than a resumed first step does (``x / n`` instead of ``x * (1 / n)``), so it keeps copies.
    """

    def _setup_model(self, model: Any) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        views = model.automatic_optimization and \
            type(model).optimizer_zero_grad is L.LightningModule.optimizer_zero_grad
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else contextlib.nullcontext():  # type: ignore[no-untyped-call]
            return ReadyOrderDDP(module=model, device_ids=device_ids,
                                 **{"gradient_as_bucket_view": views, **self._ddp_kwargs})

    def configure_ddp(self) -> None:
        super().configure_ddp()
        reducer: Any = cast(Any, self.model).reducer
        reducer._push_all_rebuilt_params()
        reducer._rebuild_buckets()


# ---------------------------------------------------------------------------------------------------------------
# Sharded training (trainer.strategy: fsdp): FSDP2 through Lightning's ModelParallelStrategy, on CPU and GPU


class RunnerFSDP(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` that shards a module without its own ``configure_model`` (runner's
    default sharding, ``shard_module`` of ``blocks``)."""

    def __init__(self, blocks: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = blocks

    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None and type(module).configure_model is L.LightningModule.configure_model:
            mesh = self.device_mesh["data_parallel"]
            blocks = self.blocks

            # An attribute of the instance: Lightning calls (and checks for) the hook by name on the module.
            def configure_model() -> None:
                shard_module(module, blocks, mesh)

            module.configure_model = configure_model  # type: ignore[method-assign]


def sharded_strategy(world: int, blocks: list[str], timeout_s: int) -> RunnerFSDP:
    """``trainer.strategy: fsdp``: Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard``) with every rank
    in one data-parallel dimension and no tensor parallelism. Lightning's ``FSDPStrategy`` (FSDP1) refuses a CPU
    accelerator; this one runs on CPU (gloo) and GPU (NCCL) alike. A module without its own ``configure_model``
    is sharded by runner (``shard_module``) when Lightning calls that hook, before the optimizer is built."""
    return RunnerFSDP(blocks, data_parallel_size=world, tensor_parallel_size=1, timeout=timedelta(seconds=timeout_s))


def shard_module(module: Any, blocks: list[str], mesh: Any) -> list[str]:
    """``fully_shard`` the blocks of ``module`` (the modules whose class name is in ``blocks``; none named: each
    direct child that holds parameters), then the module itself when parameters are left outside every block
    (then its ``training_step`` must go through ``forward``, which gathers them). Returns the sharded units'
    names. Nested blocks are sharded inner first, as FSDP2 asks. A module already sharded (its own
    ``configure_model`` ran, or a second fit) is left alone."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module, FSDPModule) or any(isinstance(m, FSDPModule) for m in module.modules()):
        return []
    if blocks:
        units = [(n, m) for n, m in module.named_modules()
                 if n and (type(m).__name__ in blocks or f"{type(m).__module__}.{type(m).__name__}" in blocks)][::-1]
    else:
        units = [(n, m) for n, m in module.named_children() if any(True for _ in m.parameters())]
    done = []
    for name, m in units:
        fully_shard(m, mesh=mesh)
        done.append(name)
    covered = {id(p) for _, m in units for p in m.parameters()}
    if any(id(p) not in covered for p in module.parameters()):
        fully_shard(module, mesh=mesh)
        done.append("<root>")
    log.info("fsdp: %d sharded units (%s)", len(done), ", ".join(done[:8]) + (" ..." if len(done) > 8 else ""))
    return done


def is_sharded(strategy: Any) -> bool:
    """Whether ``strategy`` shards the model with FSDP2 (runner's fsdp, or a program's ModelParallelStrategy)."""
    return isinstance(strategy, ModelParallelStrategy)


def is_fsdp(strategy: Any) -> bool:
    """Whether each rank holds its own shard of the gradients (FSDP1 or FSDP2)."""
    return is_sharded(strategy) or isinstance(strategy, FSDPStrategy)


def local(t: Any) -> Any:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def resident_elements(module: Any) -> tuple[int, int]:
    """(parameter elements this rank holds, the model's parameter elements)."""
    mine = total = 0
    for p in module.parameters():
        mine += local(p).numel()
        total += p.numel()
    return mine, total


def sharded_snapshot(trainer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank: (its shards of the weights and optimizer states, copied so later steps cannot change them, in
    the keys Lightning's ModelParallelStrategy loads: ``state_dict``, ``optimizer_N``; the rest of the Lightning
    checkpoint: loops, callbacks, the data module, written by rank 0 as ``meta.pt``). Nothing is gathered: each
    rank copies only its local shards."""
    ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    shards = {"state_dict": ckpt.pop("state_dict")}
    shards.update({f"optimizer_{i}": s for i, s in enumerate(ckpt.pop("optimizer_states", []))})
    copied = apply_to_collection(shards, torch.Tensor, lambda t: t.detach().clone())
    return cast(dict[str, Any], copied), ckpt


def move_epoch_position(ckpt: dict[str, Any], world: int) -> tuple[int, int, int] | None:
    """A resume on another world size, before Lightning restores its loops from ``ckpt``: when the train loader's
    saved state is a global position (``global_batches`` taken by all ranks in the epoch, and the ``world_size``
    that took them), Lightning's per-rank count of batches into the epoch becomes global_batches / ``world``, as the
    loader's own position does (the loader moves itself). Returns (global batches, the saved per-rank count, the new
    one); None, changing nothing, for any other state, or when ``world`` does not divide the global batches."""
    fit = ckpt.get("loops", {}).get("fit_loop", {})
    states = fit.get("state_dict", {}).get("combined_loader") or []
    progress = fit.get("epoch_loop.batch_progress")
    if len(states) != 1 or not isinstance(states[0], dict) or not isinstance(progress, dict):
        return None
    done, saved_world = states[0].get("global_batches"), states[0].get("world_size")
    if not isinstance(done, int) or not isinstance(saved_world, int) or saved_world == world or done % world:
        return None
    old = int(progress["current"]["ready"])
    if old * saved_world != done:  # Lightning's count and the loader's disagree: leave both as they are
        return None
    new = done // world
    for part in ("current", "total"):  # ready, started, processed, completed: each moved alike (their offsets
        for key, value in progress[part].items():  # tell Lightning where in the batch it stopped)
            progress[part][key] = int(value) + new - old
    return done, old, new


def start_next_epoch_whole(trainer: Any) -> bool:
    """A resume from a checkpoint taken at its epoch's last batch, onto a layout with more batches per rank in an
    epoch (fewer ranks): Lightning closes the saved epoch (its last batch was the loader's last) but carries the saved
    per-rank count of batches into the next epoch, which then ends that many batches early. Called in
    ``on_train_start`` (the loops restored, the new epoch's length known, the epoch loop not yet reset): the count is
    set to the epoch's last batch, so Lightning starts the next epoch at its first batch, as on the same layout.
    Returns True when it changed the count. A checkpoint taken after the epoch's end hooks (runner's since the epoch
    end is no longer skipped, ``epoch_end_follows``) needs nothing: Lightning starts the next epoch whole from it."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    batches = trainer.num_training_batches
    at_batch_end = progress.current.completed + 1 == progress.current.ready  # on_train_batch_end's state
    if not progress.is_last_batch or not at_batch_end or batches == float("inf") or \
            progress.current.completed + 1 >= batches:
        return False
    progress.current.completed = int(batches) - 1
    return True


def epoch_end_follows(trainer: Any) -> bool:
    """In ``on_train_batch_end``: whether Lightning, after this batch, validates or ends the epoch (its last batch,
    ``max_steps``). A checkpoint written here is resumed past them: Lightning's restart skips that validation and the
    epoch's end (its callbacks' ``on_train_epoch_end``, the program's ModelCheckpoint saves, EarlyStopping's check),
    so they would never run for that epoch."""
    loop = trainer.fit_loop.epoch_loop
    return bool(loop._is_training_done or loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def epoch_batches_done(trainer: Any) -> tuple[int, bool]:
    """(training batches of this epoch completed by this rank, whether the epoch's batches are all done): where a
    checkpoint written after a validation or an epoch's end stands."""
    loop = trainer.fit_loop.epoch_loop
    return int(loop.batch_progress.current.completed), bool(loop._num_ready_batches_reached())


def begin_epoch_pass(trainer: Any) -> bool:
    """Resumed at an epoch's end, in ``on_train_start`` once the RNG is the checkpoint's: make the next epoch's pass
    of the train loader now, as the uninterrupted run made it after its checkpoint (a DataLoader draws its workers'
    base seed, a ``RandomSampler`` its order, when its pass begins); Lightning made it before, in its data setup, and
    would not make it again. Nothing when Lightning reloads the loader for that epoch anyway (it makes the pass
    then). Returns whether it made the pass."""
    loop = trainer.fit_loop
    if loop._should_reload_train_dl or loop._data_fetcher is None or loop._combined_loader is None:
        return False
    for loader in loop._combined_loader.flattened:
        _set_sampler_epoch(loader, loop.epoch_progress.current.processed)
    iter(loop._data_fetcher)
    return True


def skip_batches(trainer: Any, batches: int) -> int:
    """Resumed mid-epoch with a loader that cannot restore its own position but whose epoch is a function of the
    epoch (``honesty.positioning``): in ``on_train_start`` (Lightning's loops restored, their per-rank count
    ``batches`` into the epoch; its fetcher's iterator made, not yet read by training), start this epoch's pass again
    (with the sampler's epoch set first: Lightning sets it only later, and a ``DistributedSampler`` orders by it) and
    take its first ``batches`` batches without training them, so that the next batch Lightning trains is the one the
    interrupted run would have trained next. Lightning's fetcher already counts ``batches`` as taken (it adds its count
    when the epoch loop starts). Returns the batches taken (fewer: the pass ended first)."""
    loop = trainer.fit_loop
    for loader in loop._combined_loader.flattened:
        _set_sampler_epoch(loader, loop.epoch_progress.current.processed)
    fetcher = loop._data_fetcher
    iter(fetcher)  # a fresh pass, read ahead as Lightning does (an unsized loader's first batch)
    ahead: list[Any] = getattr(fetcher, "batches", [])
    size = len(ahead)
    taken = min(size, batches)
    del ahead[:taken]
    try:
        while taken < batches:
            next(fetcher.iterator)
            taken += 1
        while len(ahead) < size:  # read ahead again, from the position
            ahead.append(next(fetcher.iterator))
    except StopIteration:
        fetcher.done = size > 0 and not ahead
    return taken


META: str = _METADATA_FILENAME  # Lightning's name for the non-tensor part of a distributed checkpoint, as it reads it
# (runner writes it as checkpoint.CheckpointDir.meta: tests/test_internals.py checks they are one name)


def checkpoint_group() -> Any:
    """A gloo process group of all ranks for the background checkpoint writes (called by every rank at once):
    the writer thread's collectives never interleave with training's in the default group."""
    return dist.new_group(backend="gloo")


def dcp_save(shards: dict[str, Any], path: Any, group: Any) -> None:
    """Write this rank's shards into ``path`` with torch's distributed checkpoint (``__R_0.distcp`` per rank;
    rank 0 writes ``.metadata`` once every rank's data is written)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(shards, checkpoint_id=path, process_group=group)


RESTORING = ("_restore_modules_and_callbacks", "restore_training_state")  # Lightning's checkpoint connector: the
# steps that read a checkpoint and apply it (the file, or DCP's load in place; model, data module, callbacks;
# optimizers, schedulers, loops), apart from the strategy's setup between them


def watch_restore(trainer: Any, watch: Any) -> None:
    """Let ``watch`` (``runner.job.fallback.LoadWatch``, or None: nothing watched) see ``trainer``'s checkpoint
    connector read and apply a checkpoint: ``watch.loading`` is True from the start of each step of ``RESTORING``
    until it returns (it stays True when one raises), and ``watch.loaded()`` runs after the restore's end
    (``resume_end``), on every rank. The connector is wrapped once; later calls only change the watch."""
    conn = trainer._checkpoint_connector
    if getattr(conn, "_runner_watch", False) is False:
        for name in RESTORING:
            setattr(conn, name, _watched(conn, getattr(conn, name)))
        end = conn.resume_end

        def resume_end() -> None:
            end()
            if conn._runner_watch is not None:
                conn._runner_watch.loaded()

        conn.resume_end = resume_end
    conn._runner_watch = watch


def _watched(conn: Any, step: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        watch = conn._runner_watch
        if watch is not None:
            watch.loading = True
        out = step(*args, **kwargs)
        if watch is not None:
            watch.loading = False
        return out

    return call
