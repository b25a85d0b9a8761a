"""Program mode on the real dev cluster inside a container (the podman tier): the same script inside podman and inside
the SIF (the rest: tests/test_program_cluster.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.dev import devcluster
from tests import test_containers, test_program_cluster
from tests.ci import unavailable
from tests.test_failures import final_weights, wait_for
from tests.test_program_cluster import (
    EVERY,
    FLAGS,
    REPO,
    STEPS,
    cluster_env,
    complete_steps,
    ended,
    exits,
    program,
    rank_log,
    ranks,
    submit,
)

pytestmark = pytest.mark.podman
undisturbed = test_program_cluster.undisturbed  # the fixtures: the run without a container,
image_overrides = test_containers.image_overrides  # the training image and its SIF

PODMAN = {"runtime": "podman", "builder": "podman", "base_image": "localhost/runner-test-base:bookworm",
          "python": "python3", "install_lightning": False,
          "pip": test_containers.IMAGE_PIP}  # the training image's line: one layer for both images


@pytest.fixture(scope="module")
def podman_image(podman_base_image: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides pointing the podman variant at the cached wheelhouse and image directory, after `runner build`
    of that config (offline: the wheelhouse holds torch 2.13.0 CPU, lightning, torchdata and runner's own wheel)."""
    if os.geteuid() != 0:
        unavailable("the podman tests need root. HINT: scripts/install-podman.sh")
    cache = test_containers.CACHE
    cache.mkdir(parents=True, exist_ok=True)
    wheelhouse = cache / f"wheelhouse-{test_containers._wheels_key()}"  # the one test_containers' image uses
    test_containers._run([str(REPO / "containers" / "wheelhouse.sh"), str(wheelhouse)], "containers/wheelhouse.sh",
                         env={**os.environ, "PYTHON": sys.executable})
    overrides = [f"container.wheelhouse={wheelhouse}", f"container.image_dir={cache / 'images'}"]
    conf = program(tmp_path_factory.mktemp("podman-build"), FLAGS, name="program-podman", block=False,
                   container=PODMAN)
    from runner import spec
    from runner.host import build, render

    cfg = spec.load(conf, overrides, start=False)  # as `runner build` reads it (the script is beside conf)
    out = subprocess.run([sys.executable, "-m", "runner", "build", str(conf), *overrides], capture_output=True,
                         text=True, timeout=test_containers.BUILD_TIMEOUT_S, cwd=conf.parent)
    if out.returncode != 0:
        unavailable(f"runner build (program, podman) failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    test_containers._prune(cache / "images", render.spec_hash(cfg, build.image_code_files(cfg)), stem="program-podman")
    return overrides


def test_the_script_trains_inside_podman(slurm_cluster: devcluster.Cluster, podman_image: list[str],
                                         undisturbed: Path, tmp_path: Path) -> None:
    """runner's settings at the top level here (the `runner:` block elsewhere); every rank trains inside the image.

    Its weights are not compared with runtime none's: in one clean-clone run the image's trajectory differed
    (loss 0.452 vs 0.492 at step 50, same package versions, Python 3.11.2 vs 3.11.7) while an earlier run had them
    bitwise equal; runner promises bitwise resumes within a runtime, not across two (tests/test_containers.py)."""
    program(tmp_path / "work", FLAGS, name="program-podman", block=False, container=PODMAN)
    run = submit(cluster_env(slurm_cluster), tmp_path / "work", tmp_path / "runs", *podman_image, block=False)
    wait_for("the podman run to end", lambda: ended(run), 240, run)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["runtime"] == "podman"
    for r in ranks(run):
        assert (r["runtime"], r["image"], r["in_container"]) == ("podman", manifest["image"], True), r
        assert r["image_spec_hash"] == manifest["spec_hash"]
    [end] = exits(run)
    assert end["outcome"] == "completed" and (run / "finished").exists(), end
    assert all(f"trained to step {STEPS}" in rank_log(run, r, 1) for r in range(4))
    assert len(final_weights(run)) == len(final_weights(undisturbed)) == 4


def test_the_script_trains_inside_the_sif(slurm_cluster: devcluster.Cluster, image_overrides: list[str],
                                          tmp_path: Path) -> None:
    """Program mode inside real Apptainer. The image is the training image's SIF: program mode's container settings
    here are the same spec (one image serves both; `container.image` names it, and runner checks its recorded spec
    hash all the same). ``${container_python}`` in the program's config starts Python in that SIF, as the ranks run,
    for jobs the program starts itself (ESPnet3's Dask workers)."""
    sif = test_containers.sif_of(image_overrides)
    work = tmp_path / "work"
    program(work, FLAGS, name="program-sif", block=False, container={**PODMAN, "runtime": "apptainer"},
            helper_python="${container_python}")
    run = submit(cluster_env(slurm_cluster), work, tmp_path / "runs", *image_overrides, f"container.image={sif}",
                 block=False)
    wait_for("the Apptainer run to end", lambda: ended(run), 240, run)
    manifest = json.loads((run / "manifest.json").read_text())
    assert (manifest["runtime"], manifest["image"]) == ("apptainer", str(sif))
    for r in ranks(run):
        assert (r["runtime"], r["image"], r["in_container"]) == ("apptainer", str(sif), True), r
        assert r["apptainer_container"] == str(sif)
    [end] = exits(run)
    assert end["outcome"] == "completed" and (run / "finished").exists(), end
    assert all(f"trained to step {STEPS}" in rank_log(run, r, 1) for r in range(4))
    assert complete_steps(run) == list(range(EVERY, STEPS + 1, EVERY))
    assert not test_containers.container_processes(sif)

    python = yaml.safe_load((run / "program" / "program.yaml").read_text())["helper_python"]
    probe = "import os, sys, runner; print(sys.prefix, os.environ['APPTAINER_CONTAINER'], os.getcwd())"
    out = subprocess.run([*shlex.split(python), "-c", probe], capture_output=True, text=True, timeout=120,
                         env=cluster_env(slurm_cluster))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["/usr", str(sif), str(work)], out.stdout
