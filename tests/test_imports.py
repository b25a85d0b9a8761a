"""A program's script imports packages the ranks' Python does not have: found before it runs (runner.job.imports),
from the script's own top-level import lines, without importing anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.job import imports

pytestmark = pytest.mark.unit

ESPNET3_RUN = """\
from __future__ import annotations
import os, sys
from pathlib import Path
import espnet3.utils.stages as stages
from espnet3.systems.asr.system import ASRSystem
from .local import data  # relative: the recipe's own
try:
    import wandb  # optional
except ImportError:
    wandb = None

def main():
    import jiwer  # only when scoring

if __name__ == "__main__":
    import torch
"""


@pytest.mark.parametrize("source, names", [
    (ESPNET3_RUN, ["os", "sys", "pathlib", "espnet3"]),
    ("import a.b.c, d\nfrom e.f import g\nimport a\n", ["a", "d", "e"]),
    ("def f(:\n", []),  # does not parse: the program's own error says more
    ("", []),
])
def test_the_top_level_imports_of_a_script(source: str, names: list[str]) -> None:
    assert imports.imported(source) == names


def test_missing_packages_are_those_this_python_cannot_find(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("")  # beside the script: found as the script runs
    (tmp_path / "mypkg").mkdir()
    script = tmp_path / "run.py"
    script.write_text("import json\nimport yaml\nimport helpers\nimport mypkg.sub\nimport espnet3_not_here\n"
                      "from no_such_package_xyz import thing\n")
    assert imports.missing(script) == ["espnet3_not_here", "no_such_package_xyz"]
    assert imports.missing(tmp_path / "gone.py") == []
