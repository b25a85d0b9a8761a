"""Alerts, the local tier: what importing runner.alerts pulls in, in a fresh interpreter (the rest:
tests/test_alerts.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_alerts import REPO

pytestmark = pytest.mark.local


def test_import_is_light():
    code = "import sys, runner.alerts; bad = {'requests', 'torch', 'lightning'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
