"""``fsdp.blocks`` at ``runner validate``: each item is a class name (``Block`` or ``module.Block``), matched
against the model's modules in the job and never imported; anything else is one line naming the item, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner import spec
from runner.errors import ConfigError
from tests.test_config import QUICKSTART, write

pytestmark = pytest.mark.unit

FSDP = ["trainer.strategy=fsdp"]


@pytest.mark.parametrize(("blocks", "key", "found"), [
    ("[1]", "fsdp.blocks[0]", "found 1;"),
    ("[Block, '']", "fsdp.blocks[1]", "found '';"),
    ("['a b']", "fsdp.blocks[0]", "found 'a b';"),
    ("[[Block]]", "fsdp.blocks[0]", "found ['Block'];"),
    ("[mod.Block, mod..Block]", "fsdp.blocks[1]", "found 'mod..Block';"),
    ("['torch.nn.Linear()']", "fsdp.blocks[0]", "found 'torch.nn.Linear()';"),
    ("[{x: 1}]", "fsdp.blocks[0]", "found {'x': 1};"),
])
def test_a_bad_block_item_is_one_line_naming_it(tmp_path: Path, blocks: str, key: str, found: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec.load(write(tmp_path, QUICKSTART), [*FSDP, f"fsdp.blocks={blocks}"])
    [line] = [p for p in err.value.problems if f": {key}: " in p]
    assert found in line and "expected a module class name like Block or mypkg.layers.Block" in line
    assert "hint: " in line and "\n" not in line and line.startswith(str(tmp_path / "conf.yaml"))


@pytest.mark.parametrize("blocks", ["[]", "[Block]", "[Linear, torch.nn.modules.linear.Linear, _Private2]"])
def test_class_names_are_accepted(tmp_path: Path, blocks: str) -> None:
    cfg = spec.load(write(tmp_path, QUICKSTART), [*FSDP, f"fsdp.blocks={blocks}"])
    assert cfg.data["fsdp"]["blocks"] == yaml.safe_load(blocks)
