"""The podman toolchain the image build relies on, end to end, with the local stand-in base image.

The Dockerfile uses the mechanism of the real template: the NGC image is the default of a build
argument declared before FROM, and tests override it with the local base.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.podman

DOCKERFILE = """\
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3
FROM ${BASE_IMAGE}
ARG TEST_VALUE=unset
LABEL runner.test.value="${TEST_VALUE}"
ENV RUNNER_TEST_VALUE="${TEST_VALUE}"
RUN python3 -c 'import yaml, jinja2, requests'
CMD ["python3", "-c", "import os; print(os.environ['RUNNER_TEST_VALUE'])"]
"""


def podman(*args: str) -> str:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def test_build_from_local_base_label_run_save(podman_base_image: str, tmp_path: Path) -> None:
    token = uuid.uuid4().hex[:12]
    tag = f"localhost/runner-podman-env-test:{token}"
    value = f"run {token}"  # a space: the value must survive build-arg, LABEL and ENV quoting
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    archive = tmp_path / "image.tar"
    try:
        podman(
            "build", "--format", "docker", "--build-arg", f"BASE_IMAGE={podman_base_image}",
            "--build-arg", f"TEST_VALUE={value}", "--tag", tag, str(context),
        )  # fmt: skip

        [info] = json.loads(podman("image", "inspect", tag))
        assert info["Labels"]["runner.test.value"] == value

        assert podman("run", "--rm", tag) == f"{value}\n"

        podman("save", "--format", "docker-archive", "-o", str(archive), tag)
        with tarfile.open(archive) as tar:
            manifest_file = tar.extractfile("manifest.json")
            assert manifest_file is not None
            [manifest] = json.load(manifest_file)
        assert manifest["RepoTags"] == [tag]
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, check=False)
        archive.unlink(missing_ok=True)
