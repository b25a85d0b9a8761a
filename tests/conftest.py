"""Shared fixtures: real services (Slurm cluster, webhook server, podman) are pytest plugins in tests/."""

pytest_plugins = ["tests.webhook_server"]
