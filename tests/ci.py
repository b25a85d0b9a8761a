"""Skip on a developer machine, fail in CI: tests that need root, Slurm or podman never pass by skipping."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def need(ok: bool, reason: str) -> None:
    if not ok:
        unavailable(reason)
