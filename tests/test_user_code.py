"""User code in the job: targets imported before training, the real global batch measured, resume exactness said.

Real local runs in tests/test_user_code_local.py (2 processes, gloo DDP on CPU) of Lightning's own BoringModel +
BoringDataModule, which take none of runner's ``dataloader`` settings and train on a plain DataLoader (issue 13,
"Your own model").
"""

from __future__ import annotations

import pytest
import torch

from runner.job import honesty, targets

pytestmark = pytest.mark.unit


def test_batch_len_and_resumable() -> None:
    assert honesty.batch_len(torch.zeros(3, 2)) == 3
    assert honesty.batch_len({"x": [torch.zeros(5)], "n": 1}) == 5
    assert honesty.batch_len("text") is None
    assert not honesty.resumable(torch.utils.data.DataLoader(range(4)))
    from runner.dev.example import ShardLoader
    assert honesty.resumable(ShardLoader.__new__(ShardLoader))


def test_target_import_problem_is_one_line() -> None:
    assert targets.problem("runner.dev.example.TinyRegressor") is None
    assert "cannot import nowhere_pkg" in (targets.problem("nowhere_pkg.Data") or "")
    assert "has no class or function 'Nope'" in (targets.problem("runner.dev.example.Nope") or "")
