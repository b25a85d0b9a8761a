"""Shared fixtures: real services (Slurm cluster, webhook server, podman) are pytest plugins in tests/."""

import logging
from collections.abc import Iterator

import pytest

pytest_plugins = ["tests.webhook_server", "tests.slurm_fixture", "tests.podman_fixture"]


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the templates")


@pytest.fixture(autouse=True)
def _fresh_runner_logger() -> Iterator[None]:
    """`runner.log.setup` (called by every CLI entry) configures the process-wide `runner` logger; a test that
    ran `cli.main` must not change what the next test's caplog sees."""
    logger = logging.getLogger("runner")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
