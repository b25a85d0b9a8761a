"""Shared fixtures: real services (Slurm cluster, webhook server, podman) are pytest plugins in tests/."""

pytest_plugins = ["tests.webhook_server", "tests.slurm_fixture", "tests.podman_fixture"]


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the templates")
