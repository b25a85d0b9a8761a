"""The launcher's callbacks combined into one: each part sees the very hooks, in the same order, as on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")

from runner.dev.example import ShardedDataModule, TinyRegressor  # noqa: E402
from runner.job.callback import combine  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def _parts(calls: list[tuple[str, str, int]]) -> list[Any]:
    class First(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            calls.append(("first", "train_start", trainer.global_step))

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            calls.append(("first", "before_backward", trainer.global_step))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            calls.append(("first", "batch_end", batch_idx))

    class Second(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            calls.append(("second", "batch_end", batch_idx))

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            calls.append(("second", "before_optimizer_step", trainer.global_step))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            calls.append(("second", "train_end", trainer.global_step))

    return [First(), Second()]


def _fit(tmp_path: Path, combined: bool) -> list[tuple[str, str, int]]:
    calls: list[tuple[str, str, int]] = []
    parts = _parts(calls)
    trainer = L.Trainer(max_steps=3, callbacks=[combine(parts)] if combined else parts, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, default_root_dir=str(tmp_path))
    trainer.fit(TinyRegressor(), datamodule=ShardedDataModule(dataloader={"train": {"batch_size": 8}}))
    return calls


def test_combined_parts_see_the_same_hooks_as_separate_callbacks(tmp_path: Path) -> None:
    alone = _fit(tmp_path / "alone", combined=False)
    assert ("second", "before_optimizer_step", 2) in alone and alone[-1] == ("second", "train_end", 3)
    assert _fit(tmp_path / "combined", combined=True) == alone


def test_parts_with_state_are_refused() -> None:
    class Stateful(L.Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"n": 1}

    with pytest.raises(TypeError, match="state_dict"):
        combine([Stateful()])


def test_the_factory_gives_nothing_outside_a_run_of_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed in an image, runner's entry point is inert in any process its launcher did not start."""
    from runner.job import jobenv, program_entry

    monkeypatch.delenv(jobenv.PROGRAM_ENV, raising=False)
    assert program_entry.factory() == []
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert not [cb for cb in trainer.callbacks if type(cb).__name__ == "RunnerCallbacks"]


def test_a_copied_runner_package_still_declares_its_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """runner copied into an image (container.code) has no package metadata: the launcher declares the factory."""
    import sys
    from importlib import metadata

    from runner.job import program
    from runner.rundir import RunDir

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [])  # as where runner was only copied
    program.entry_point(RunDir(tmp_path))
    where = str(tmp_path / "python")
    assert sys.path[-1] == where and program.os.environ["PYTHONPATH"] == f"/elsewhere:{where}"
    [dist] = metadata.distributions(path=[where])
    assert [(e.group, e.value) for e in dist.entry_points] == [(program.GROUP, "runner.job.program_entry:factory")]


@pytest.mark.parametrize("command, here", [
    (["python", "train.py", "--lr", "1e-3"], True),
    (["python3.12", "-m", "recipe.train", "--stage", "5"], True),
    (["<this interpreter>", "train.py"], True),
    (["/opt/other-venv/bin/python", "train.py"], False),  # another interpreter's packages: a child process
    (["python", "-u", "train.py"], False),  # interpreter options: the interpreter itself runs it
    (["python", "-m"], False),
    (["python"], False),
    (["bash", "run.sh"], False),
    (["torchrun", "--nproc_per_node=8", "train.py"], False),
])
def test_which_commands_run_in_the_ranks_own_process(command: list[str], here: bool) -> None:
    import sys

    from runner.job import program

    assert program.in_process([sys.executable if c == "<this interpreter>" else c for c in command]) is here
