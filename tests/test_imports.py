"""A program's script imports packages the ranks' Python does not have: found before it runs (runner.job.imports),
from the script's own top-level import lines, without importing anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.job import imports, program

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


@pytest.mark.parametrize("command, needs", [
    # a script: its top-level third-party imports, with the line; stdlib and its own code beside it left out
    ("python run.py --stages train", [("yaml", "run.py:3", "import yaml"), ("espnet3_not_here", "run.py:6",
                                      "import espnet3_not_here.stages as s"),
                                      ("no_such_package_xyz", "run.py:7", "from no_such_package_xyz import thing")]),
    ("python3 run.py", [("yaml", "run.py:3", "import yaml"), ("espnet3_not_here", "run.py:6",
                         "import espnet3_not_here.stages as s"),
                        ("no_such_package_xyz", "run.py:7", "from no_such_package_xyz import thing")]),
    ("python -m espnet3_not_here.run --x", [("espnet3_not_here", "python -m", "espnet3_not_here.run")]),
    ("python -m mypkg.train", []),  # the working directory's own package
    ("python -m json.tool", []),  # the standard library's
    ("python -m helpers", []),
    ("fabric run --devices 2 run.py", [("yaml", "run.py:3", "import yaml"), ("espnet3_not_here", "run.py:6",
                                        "import espnet3_not_here.stages as s"),
                                       ("no_such_package_xyz", "run.py:7", "from no_such_package_xyz import thing")]),
    ("/opt/other-venv/bin/python run.py", []),  # another interpreter: its packages are not this Python's
    ("bash train.sh", []),
    ("python gone.py", []),  # no script: `not_found` says so before
], ids=["script", "python3", "module", "own-module", "stdlib-module", "own-file-module", "fabric", "other-python",
        "binary", "no-script"])
def test_what_a_command_needs_from_the_ranks_python(tmp_path: Path, command: str,
                                                    needs: list[tuple[str, str, str]]) -> None:
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "run.py").write_text("from __future__ import annotations\nimport json, os\nimport yaml\n"
                                     "import helpers\nimport mypkg.sub\nimport espnet3_not_here.stages as s\n"
                                     "from no_such_package_xyz import thing\nimport yaml.constructor\n")
    assert [tuple(n) for n in program.needs(command.split(), tmp_path)] == needs


def test_what_this_python_lacks_of_what_a_program_needs(tmp_path: Path) -> None:
    (tmp_path / "run.py").write_text("import yaml\nimport espnet3_not_here\nimport torch\n")
    lacking = imports.lacking(program.needs(["python", "run.py"], tmp_path))
    assert [n.package for n in lacking] == ["espnet3_not_here"]
    assert program.refusal(lacking, "/x/bin/python in apptainer /i.sif") == \
        "/x/bin/python in apptainer /i.sif cannot find espnet3_not_here, which run.py:2 imports: " \
        "`import espnet3_not_here`"
    assert program.refusal(imports.lacking(program.needs(["python", "-m", "nope_pkg.run"], tmp_path))).endswith(
        "cannot find nope_pkg, which python -m imports: `nope_pkg.run`")
