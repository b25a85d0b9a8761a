"""`runner submit`'s 2-node config, in process (the unit tier; the real cluster: tests/test_slurm_submit.py)."""

from __future__ import annotations

import pytest

from runner import spec
from tests.test_slurm_submit import CONF

pytestmark = pytest.mark.unit


def test_config_is_valid_and_world_size_4() -> None:
    cfg = spec.load(CONF)
    assert cfg.world_size == 4 and cfg.data["scheduler"] == "slurm" and cfg.data["container"]["runtime"] == "none"
    assert cfg.global_batch == 32
