"""`runner build` with real podman builds (the podman tier): the local stand-in for the NGC image through the same
Dockerfile, the layer cache, the archive for Apptainer (the rest: tests/test_build.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from runner.host import build, render, submit
from tests.test_build import write_config

pytestmark = pytest.mark.podman


def podman(*args: str, timeout: float = 300) -> str:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"podman {' '.join(args)}: {out.stderr}"
    return out.stdout


def runner_build(cfg: Path, *args: str, apptainer: bool = True) -> subprocess.CompletedProcess[str]:
    # The same runner as this process (its files are in the spec hash), whatever the venv has installed.
    env = {**os.environ, "PYTHONPATH": str(Path(build.__file__).resolve().parents[1])}
    if not apptainer:  # a build host without it: the archive is what the build leaves
        where = Path(shutil.which("apptainer") or "/nonexistent").parent
        env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep) if Path(d) != where)
    return subprocess.run([sys.executable, "-m", "runner", "build", str(cfg), *args], capture_output=True, text=True,
                          timeout=600, cwd=cfg.parent, env=env)


@pytest.fixture(scope="module")
def real(podman_base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real cold build of the rendered Dockerfile from the local base, in a git repo with a dirty file."""
    d = tmp_path_factory.mktemp("realbuild")
    git = ["git", "-C", str(d), "-c", "user.name=t", "-c", "user.email=t@t"]
    # Its own name (so its own tag) per session: concurrent test runs do not remove each other's images.
    cfg = write_config(d, name=f"buildtest-{os.getpid()}", base=podman_base_image, extra="# v1\n")
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", cfg.name], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    commit = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    cfg.write_text(cfg.read_text() + "# edited, not committed\n")
    t0 = time.monotonic()
    result = runner_build(cfg, "--force", apptainer=False)
    seconds = time.monotonic() - t0
    bp = build.plan(cfg)
    yield {"cfg": cfg, "result": result, "plan": bp, "commit": commit, "seconds": seconds}
    tags = [json.loads(f.read_text())["tag"] for f in (d / "images").glob("*.json")]
    subprocess.run(["podman", "rmi", "--force", *tags], capture_output=True, timeout=300, check=False)


def test_real_build_labels_env_workdir_code(real: Any) -> None:
    result, bp = real["result"], real["plan"]
    assert result.returncode == 0, result.stdout + result.stderr
    [info] = json.loads(podman("image", "inspect", bp.tag))
    labels = info["Config"]["Labels"]
    assert labels["runner.spec_hash"] == bp.spec_hash and labels["runner.version"] == render.__version__
    assert labels["runner.base_image"] == "localhost/runner-test-base:bookworm"
    assert labels["runner.base_digest"].startswith("localhost/runner-test-base@sha256:")
    assert labels["runner.git_commit"] == real["commit"] and labels["runner.git_dirty"] == "true"
    assert labels["org.opencontainers.image.revision"] == real["commit"]
    # As `runner build` reads it (start=False): a local config whose image is built for Slurm
    assert labels["runner.config_hash"] == submit.spec.load(real["cfg"], start=False).hash()
    freeze = json.loads(labels["runner.pip_freeze"])
    assert "PyYAML==6.0" in freeze and any(x.startswith("requests==") for x in freeze)
    assert "PYTHONPATH=/workspace" in info["Config"]["Env"] and info["Config"]["WorkingDir"] == "/workspace"
    # Built in docker format: the Dockerfile's SHELL (bash -o pipefail) held for its RUN lines (OCI has no SHELL).
    assert info["ManifestType"] == "application/vnd.docker.distribution.manifest.v2+json"
    record = json.loads(bp.paths.record.read_text())
    assert record["labels"] == {k: v for k, v in labels.items() if k in record["labels"]}
    assert record["pip_freeze"] == freeze and record["git_dirty"] is True


def test_real_image_holds_the_code_and_runs_the_launcher(real: Any) -> None:
    bp = real["plan"]
    assert podman("run", "--rm", bp.tag, "python3", "-m", "runner.job.launch", "--version").strip() == \
        f"runner {render.__version__}"
    listing = podman("run", "--rm", bp.tag, "sh", "-c",
                     "pwd; sha256sum runner/host/build.py; cat /etc/runner-spec.json")
    pwd, digest, spec = listing.split("\n", 2)
    assert pwd == "/workspace"
    assert digest.split()[0] == json.loads(spec)["code"]["runner/host/build.py"]
    assert json.loads(spec)["spec_hash"] == bp.spec_hash
    assert podman("run", "--rm", bp.tag, "python3", "-c", "import yaml; print(yaml.__version__)").strip() == "6.0"


def test_real_archive_is_ready_for_apptainer(real: Any) -> None:
    result, bp = real["result"], real["plan"]
    with tarfile.open(bp.paths.archive) as tar:  # an OCI image layout: index -> manifest -> config

        def blob(digest: str) -> Any:
            f = tar.extractfile(f"blobs/{digest.replace(':', '/')}")
            assert f is not None
            return json.load(f)
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        [entry] = index["manifests"]
        image_config = blob(blob(entry["digest"])["config"]["digest"])["config"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == bp.tag
    assert image_config["Labels"]["runner.spec_hash"] == bp.spec_hash
    assert f"oci-archive:{bp.paths.archive.name}" in result.stdout and not bp.paths.sif.exists()
    definition = bp.paths.definition.read_text()
    assert f"Bootstrap: oci-archive\nFrom: {bp.paths.archive}\n" in definition
    assert "@{" not in definition and "{{" not in definition
    if shutil.which("apptainer") is None:
        return
    # Where Apptainer is, the next build makes only the SIF, and the archive (the image's second copy) goes.
    sif = runner_build(real["cfg"])
    assert sif.returncode == 0, sif.stdout + sif.stderr
    assert "[1/2] sif: " in sif.stdout and bp.paths.sif.is_file() and not bp.paths.archive.exists()
    labels = json.loads(subprocess.run(["apptainer", "inspect", "--json", "--labels", str(bp.paths.sif)],
                                       capture_output=True, text=True, timeout=60, check=True).stdout)
    assert labels["data"]["attributes"]["labels"]["runner.spec_hash"] == bp.spec_hash


def test_real_second_build_does_nothing(real: Any) -> None:
    record = real["plan"].paths.record
    before = record.stat().st_mtime_ns
    t0 = time.monotonic()
    result = runner_build(real["cfg"])
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stdout and "[1/" not in result.stdout
    assert record.stat().st_mtime_ns == before and time.monotonic() - t0 < 10


def test_real_force_rebuilds_from_the_layer_cache(real: Any) -> None:
    bp = real["plan"]
    before = bp.paths.record.stat().st_mtime_ns
    result = runner_build(real["cfg"], "--force", apptainer=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1/" in result.stdout and bp.paths.archive.stat().st_mtime_ns > before  # the archive is rewritten
    assert "Using cache" in (bp.paths.logs / "image.log").read_text()
    assert json.loads(bp.paths.record.read_text())["spec_hash"] == bp.spec_hash


def test_real_changed_pip_pin_rebuilds(real: Any) -> None:
    cfg = real["cfg"]
    result = runner_build(cfg, 'container.pip=["PyYAML>=6.0,<7"]')
    assert result.returncode == 0, result.stdout + result.stderr
    new = build.plan(cfg, ['container.pip=["PyYAML>=6.0,<7"]'])
    assert new.spec_hash != real["plan"].spec_hash and new.up_to_date
    assert "[1/" in result.stdout and f"built {new.paths.sif if new.wants_sif and new.sif_tool else new.tag}" \
        in result.stdout
    [info] = json.loads(podman("image", "inspect", new.tag))
    assert info["Config"]["Labels"]["runner.spec_hash"] == new.spec_hash
    assert "PyYAML==6.0" in json.loads(info["Config"]["Labels"]["runner.pip_freeze"])
    dockerfile = (new.paths.build_dir / "Dockerfile").read_text()
    assert "RUN python3 -m pip install 'PyYAML>=6.0,<7'\n" in dockerfile


def test_real_ngc_dockerfile_builds_from_the_build_arg(real: Any, podman_base_image: str) -> None:
    """The Dockerfile rendered for the NGC base builds from another base given only as --build-arg."""
    bp = build.plan(real["cfg"], ["container.base_image=null"])
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3\n" in bp.files["Dockerfile"].decode()
    build.write_build_dir(bp)
    tag = f"{bp.tag}-buildarg"
    try:
        podman("build", "--format", "docker", "--file", str(bp.paths.dockerfile), "--build-arg",
               f"BASE_IMAGE={podman_base_image}", "--tag", tag, str(bp.paths.build_dir))
        [info] = json.loads(podman("image", "inspect", tag))
        assert info["Config"]["Labels"]["runner.base_image"] == podman_base_image
        assert podman("run", "--rm", tag, "python3", "-m", "runner.job.launch", "--version").startswith("runner ")
    finally:
        subprocess.run(["podman", "rmi", "--force", tag], capture_output=True, timeout=300, check=False)


def test_real_failing_step_names_step_and_log(real: Any) -> None:
    result = runner_build(real["cfg"], 'container.pip=["/nonexistent/missing.whl"]')
    assert result.returncode == 1
    bp = build.plan(real["cfg"], ['container.pip=["/nonexistent/missing.whl"]'])
    log = bp.paths.logs / "image.log"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("runner: error: build step 'image' (build the image) failed (exit ")
    assert last.endswith(f"; log: {log}")
    assert "missing.whl" in result.stderr and "missing.whl" in log.read_text()
    assert not bp.paths.record.exists()
