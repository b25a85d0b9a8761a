"""`ruff check bench` (scripts/test.sh) reads every bench/ script, also the ones without a `.py` extension."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_every_bench_script_is_in_ruffs_extend_include() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    ruff = pyproject[pyproject.index("[tool.ruff]"):pyproject.index("[tool.ruff.lint]")]
    scripts = {f"bench/{p.name}" for p in (REPO / "bench").iterdir()
               if p.is_file() and p.suffix != ".py" and p.read_text().startswith("#!/usr/bin/env python")}
    assert scripts, "no bench/ script found"
    missing = sorted(s for s in scripts if f'"{s}"' not in ruff)
    assert not missing, f"add to [tool.ruff] extend-include in pyproject.toml: {missing}"
