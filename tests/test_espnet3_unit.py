"""ESPnet3's recipe under runner, the unit tier: what the podman variant installs (the rest: tests/test_espnet3.py,
_cluster, _podman)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.test_espnet3 import EXAMPLE, REPO

pytestmark = pytest.mark.unit


def test_the_podman_variant_installs_the_packages_of_the_requirements_file() -> None:
    """podman.yaml names the packages, containers/espnet3-requirements.txt their versions (the wheelhouse holds one
    of each): the two lists stay the same, plus runner's own wheel."""
    lines = (REPO / "containers" / "espnet3-requirements.txt").read_text().splitlines()
    required = [re.split(r"[=<>!~ ]", line, maxsplit=1)[0] for line in lines if line and not line.startswith("#")]
    podman = yaml.safe_load("runner:\n" + (EXAMPLE / "podman.yaml").read_text())["runner"]["container"]
    assert podman["pip"] == [*required, "runner[train]"]
    assert podman["runtime"] == "podman" and podman["python"] == "python3.12"
