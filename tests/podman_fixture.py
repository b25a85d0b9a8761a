"""pytest plugin: a local base image for real podman builds.

The real Dockerfile starts FROM the NGC PyTorch image, which test machines cannot pull; tests pass
this image as ``--build-arg BASE_IMAGE=...`` instead. Load the plugin from the top-level conftest
(``pytest_plugins = ["tests.podman_fixture"]``) or from a test module.

Where the plugin may set the machine up (CI, or running as root) it runs
``scripts/install-podman.sh`` and ``scripts/make-base-image.sh``, both quick when already done.
Elsewhere it uses what is there and skips with a reason when podman or the image is missing; in CI
(``CI=true``) a missing podman fails instead, so these tests are never silently skipped there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ci import in_ci, unavailable

BASE_IMAGE = "localhost/runner-test-base:bookworm"
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT_TIMEOUT_S = 900  # a cold base image takes 35-80 s here; a slow mirror takes longer




def _run_script(name: str, *args: str) -> None:
    argv = [str(SCRIPTS / name), *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        unavailable(f"{name} ran longer than {SCRIPT_TIMEOUT_S} s")
    else:
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            unavailable(f"{name} failed (exit {proc.returncode}):\n{tail}")


def _image_exists(image: str) -> bool:
    proc = subprocess.run(["podman", "image", "exists", image], capture_output=True, check=False)
    return proc.returncode == 0


@pytest.fixture(scope="session")
def podman_base_image() -> str:
    """Reference of a local image standing in for nvcr.io/nvidia/pytorch: bash, apt, python3, pip,
    yaml, jinja2, requests; no torch, no CUDA."""
    if in_ci() or os.geteuid() == 0:
        _run_script("install-podman.sh")
        _run_script("make-base-image.sh", BASE_IMAGE)
    elif shutil.which("podman") is None:
        unavailable("podman is not installed. HINT: sudo scripts/install-podman.sh")
    elif not _image_exists(BASE_IMAGE):
        unavailable(
            f"no image {BASE_IMAGE} in this user's podman storage; the scripts build it for root."
            " HINT: run the podman tests as root"
        )
    return BASE_IMAGE
