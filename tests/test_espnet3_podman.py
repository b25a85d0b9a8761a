"""ESPnet3's mini_an4 recipe inside the podman image on the dev cluster (the podman tier; the recipe and the local runs:
tests/test_espnet3.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runner.dev import devcluster
from tests import test_containers, test_espnet3
from tests.ci import unavailable
from tests.test_espnet3 import (
    CONF,
    EXAMPLE,
    NO_PAUSE,
    REPO,
    TRAIN,
    assert_same_stats,
    cancel_a_worker_mid_way,
    espnet3_python,
    one_run,
    submit,
)
from tests.test_failures import events, status, wait_for
from tests.test_program_cluster import cluster_env, exits
from tests.test_program_cluster import ranks as rank_info

pytestmark = pytest.mark.podman
recipe = test_espnet3.recipe


PY312_BASE = "localhost/runner-test-base:bookworm-py312"


IMAGE_TIMEOUT_S = 1800  # measured cold: wheelhouse 31 s, base 35 s, image ~5 min (2 cores)


def _image_step(argv: list[str], what: str, cwd: Path = REPO) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=IMAGE_TIMEOUT_S, cwd=cwd)
    except subprocess.TimeoutExpired:
        unavailable(f"{what} ran longer than {IMAGE_TIMEOUT_S} s")
    if out.returncode != 0:
        unavailable(f"{what} failed (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout + out.stderr


@pytest.fixture(scope="session")
def espnet3_image(podman_base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The podman variant's config (``prepare.sh DEST --podman WHEELHOUSE``), after ``runner build`` of it: the
    stand-in base with Python 3.12, the wheelhouse (its name keyed by what its wheels are made of) and the image are
    each made once and found again by later sessions. Older wheelhouses (3 GB) and images of this config go."""
    python = espnet3_python()
    if os.geteuid() != 0:
        unavailable("the podman tests need root. HINT: scripts/install-podman.sh")
    _image_step([str(REPO / "containers" / "test-base-py312.sh"), PY312_BASE], "containers/test-base-py312.sh")
    cache = test_containers.CACHE
    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(test_containers._wheels_key().encode() + b"".join(
        (REPO / "containers" / f).read_bytes() for f in ("espnet3-requirements.txt", "wheelhouse-espnet3.sh")))
    wheelhouse = cache / f"wheelhouse-espnet3-{key.hexdigest()[:12]}"
    for old in cache.glob("wheelhouse-espnet3-*"):
        if old != wheelhouse and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    _image_step([str(REPO / "containers" / "wheelhouse-espnet3.sh"), str(wheelhouse)],
                "containers/wheelhouse-espnet3.sh")
    work = tmp_path_factory.mktemp("espnet3-podman") / "mini_an4"
    _image_step([str(EXAMPLE / "prepare.sh"), str(work), "--podman", str(wheelhouse)], "prepare.sh --podman")
    build = [str(python), "-m", "runner", "build", CONF, f"runner.container.image_dir={cache / 'images'}"]
    plan = _image_step([*build, "--dry-run"], "runner build --dry-run", cwd=work)
    spec_hash = re.search(r"spec hash: +([0-9a-f]{12})", plan)
    assert spec_hash, "runner build --dry-run printed no spec hash"
    _image_step(build, "runner build (the ESPnet3 podman image)", cwd=work)
    test_containers._prune(cache / "images", spec_hash[1], stem="mini-an4")
    return work / CONF


def test_train_stage_inside_the_podman_image_on_two_nodes_of_two_ranks(slurm_cluster: devcluster.Cluster,
                                                                       recipe: Path, espnet3_image: Path,
                                                                       tmp_path: Path) -> None:
    """The recipe (prepared by the ``recipe`` fixture, on the venv) trains with the podman variant's config: every
    rank inside the image; ESPnet3's experiment in the recipe's exp/, as with runtime none."""
    conf = "conf/training_asr_transformer_podman.yaml"
    shutil.copy(espnet3_image, recipe / conf)
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=podman_train", "trainer.max_epochs=3",
                 f"runner.container.image_dir={test_containers.CACHE / 'images'}", conf=conf)
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("the training job to end", lambda: bool(exits(run)), 600, run)
    [end] = exits(run)
    assert (end["outcome"], end["exit_code"]) == ("completed", 0), end
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["runtime"] == "podman" and manifest["image"].startswith("localhost/runner-mini-an4:"), manifest
    info = rank_info(run)
    assert sorted(r["hostname"] for r in info) == ["n1", "n1", "n2", "n2"]
    for r in info:
        assert (r["runtime"], r["image"], r["in_container"]) == ("podman", manifest["image"], True), r
    # The preflight names the Python the ranks run, the image's, and found what run.py imports in it.
    python = [c for c in json.loads((run / "preflight.json").read_text())["checks"] if c["name"] == "python"]
    assert sorted(c["node"] for c in python) == ["n1", "n2"], python  # each node's first rank checks its own
    assert {(c["status"], c["value"], c["threshold"]) for c in python} == \
        {("pass", f"/usr/local/bin/python3.12 in podman {manifest['image']}", "finds espnet3")}, python
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == 3 * 4  # ESPnet3's global step
    exp = recipe / "exp" / "podman_train"
    assert (exp / "last.ckpt").exists() and list(exp.glob("epoch*valid.loss.ckpt"))
    assert "valid/loss" in (exp / "train.log").read_text()
    assert status(env, run)["state"] == "completed"


def test_collect_stats_workers_run_in_the_image_and_survive_a_cancel(slurm_cluster: devcluster.Cluster,
                                                                     recipe: Path, espnet3_image: Path,
                                                                     tmp_path: Path) -> None:
    """collect_stats with env: slurm inside the podman image: the stage's process submits ESPnet3's dask-jobqueue
    workers from inside the image (Slurm's client in it, the cluster's slurm.conf and munge socket bound), each
    worker job starts Python in the same image (``python: ${container_python}``); one is cancelled mid-way, and the
    statistics still equal those of env: local."""
    conf = "conf/training_asr_transformer_podman_stats.yaml"
    shutil.copy(espnet3_image, recipe / conf)
    env = cluster_env(slurm_cluster)
    stats = recipe / "exp" / "stats_podman"
    out = submit(recipe, env, tmp_path / "runs", "stages=collect_stats", "runner.scheduler=slurm",
                 f"runner.container.image_dir={test_containers.CACHE / 'images'}",
                 f"runner.container.binds=[{slurm_cluster.root}]", "parallel.env=slurm", "parallel.n_workers=2",
                 f"stats_dir={stats}", "exp_tag=stats_podman",
                 "parallel.options={cores: 1, memory: 1000MB, processes: 1, walltime: '00:20:00', "
                 f"worker_extra_args: [{NO_PAUSE}]}}", "parallel.options.python=${container_python}", conf=conf)
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    program = yaml.safe_load((run / "program" / Path(conf).name).read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    assert program["parallel"]["options"]["python"].startswith("podman run --rm ")
    assert program["parallel"]["options"]["python"].endswith(f" {manifest['image']} python3.12")

    def in_the_image() -> bool:  # a worker, in the run's image
        return "distributed.cli.dask_worker" in subprocess.run(
            ["podman", "ps", "--no-trunc", "--filter", f"ancestor={manifest['image']}", "--format", "{{.Command}}"],
            capture_output=True, text=True, timeout=30).stdout

    cancel_a_worker_mid_way(env, run, stats, in_the_image)
    assert json.loads((run / "ranks" / "rank-00000.json").read_text())["in_container"] is True  # the stage's one
    assert_same_stats(stats, recipe / "exp" / "stats")


def test_the_apptainer_variant_is_the_sif_of_that_image_and_runs_every_rank_in_it(espnet3_image: Path,
                                                                                  tmp_path: Path) -> None:
    """The README's Apptainer variant, as planned (no SIF is built here: making the SIF of this 6.3 GB image took 632 s
    on this 2-core machine, `runner build` 697 s in all, past what the podman tier can pay on each spec): with
    ``runner.container.runtime=apptainer`` on the podman variant's config, `runner build` makes the SIF of the very
    podman image the podman test trains in (same spec hash and tag: podman build, its oci-archive, ``apptainer
    build``, then the SIF's %test), and `runner submit` of the train stage on 2 nodes x 2 ranks runs each rank as
    ``apptainer exec`` of that SIF with the image's Python, the recipe directory bound at its own path."""
    python, work = espnet3_python(), espnet3_image.parents[1]
    conf = espnet3_image.relative_to(work)
    images = test_containers.CACHE / "images"
    common = [f"runner.container.image_dir={images}", "runner.container.runtime=apptainer"]
    plan = _image_step([str(python), "-m", "runner", "build", str(conf), *common, "--dry-run"],
                       "runner build --dry-run (Apptainer)", cwd=work)
    podman = _image_step([str(python), "-m", "runner", "build", str(conf), common[0], "--dry-run"],
                         "runner build --dry-run (podman)", cwd=work)
    spec_hash = re.search(r"spec hash: +([0-9a-f]{12})", podman)
    assert spec_hash and f"spec hash:   {spec_hash[1]}" in plan, plan
    sif = images / f"mini-an4-{spec_hash[1]}.sif"
    tag = f"localhost/runner-mini-an4:{spec_hash[1]}"
    steps = [line.split(":")[0] for line in plan.splitlines() if re.match(r"\[\d/\d\] ", line)]
    assert steps == ["[1/7] image", "[2/7] freeze", "[3/7] base", "[4/7] label", "[5/7] save", "[6/7] sif",
                     "[7/7] test"], plan
    assert f"--format oci-archive --output {sif.with_suffix('.tar')} {tag}" in plan
    assert f"apptainer build --force --notest --disable-cache {sif} " in plan and f"apptainer test {sif}" in plan
    assert f"From: {sif.with_suffix('.tar')}" in plan and "Bootstrap: oci-archive" in plan
    out = subprocess.run([str(python), "-m", "runner", "submit", str(conf), *common, *TRAIN[:4], "--dry-run",
                          "--allow-missing-image", f"runner.run_root={tmp_path / 'runs'}"], capture_output=True,
                         text=True, cwd=work, timeout=120, env=test_espnet3.local_env())
    assert out.returncode == 0, out.stdout + out.stderr
    [srun] = [line.strip() for line in out.stdout.splitlines() if " srun " in line and "apptainer exec" in line]
    assert f"--bind {work}:{work}," in srun and f" {sif} python3.12 -m runner.job.launch " in srun, srun
