"""Training inside the image on the real dev cluster (2 nodes x 2 ranks, CPU/gloo): real podman, and the Apptainer
stand-in (tests/standin/apptainer: squashfs + bubblewrap, since Apptainer cannot be installed here).

The training image is built once per test session, offline, from a wheelhouse made on this machine (torch 2.13.0
CPU, lightning, runner's own wheel) and the local Debian base; both are cached across sessions by content hash
(the wheelhouse by runner's source, the image by its spec hash) under /var/tmp/runner-test-cache.

Few full runs, each asserting much: every run costs minutes of CPU shared with other test sessions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner import spec
from runner.dev import devcluster
from runner.host import build, render, submit
from tests.ci import unavailable
from tests.conftest import fixture_tier
from tests.test_failures import BASE, checkpoint_done, events, final_weights, job_id, runner, status, wait_for

pytestmark = pytest.mark.podman  # on the dev cluster too (slurm_cluster)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "slurm-2node-podman.yaml"
STANDIN = REPO / "tests" / "standin"
CACHE = Path("/var/tmp/runner-test-cache")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_TIMEOUT_S = 1200


def _source_key() -> str:
    """What runner's wheel is made of: a new key (and wheelhouse, and image) only when runner changes."""
    h = hashlib.sha256()
    files = [REPO / "pyproject.toml", REPO / "containers" / "wheelhouse.sh",
             *sorted((REPO / "runner").rglob("*.py")), *sorted((REPO / "templates").glob("*"))]
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        unavailable(f"{what} ran longer than {BUILD_TIMEOUT_S} s")
    if out.returncode != 0:
        unavailable(f"{what} failed (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout


@pytest.fixture(scope="session")
def image_overrides(podman_base_image: str) -> list[str]:
    """Overrides that point conf/slurm-2node-podman.yaml at the cached wheelhouse and image directory, after
    building (or finding) the podman image and the stand-in's SIF of that spec."""
    if os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("mksquashfs") is None:
        unavailable("the container tests need root, bubblewrap and squashfs-tools. HINT: scripts/install-podman.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    wheelhouse = CACHE / f"wheelhouse-{_source_key()}"
    for old in CACHE.glob("wheelhouse-*"):
        if old != wheelhouse and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    _run([str(REPO / "containers" / "wheelhouse.sh"), str(wheelhouse)], "containers/wheelhouse.sh",
         env={**os.environ, "PYTHON": sys.executable})
    overrides = [f"container.wheelhouse={wheelhouse}", f"container.image_dir={CACHE / 'images'}"]
    cli = [sys.executable, "-m", "runner", "build", str(CONF), *overrides]
    _run(cli, "runner build (podman)")
    _run([*cli, "container.runtime=apptainer"], "runner build (the Apptainer stand-in's SIF)",
         env={**os.environ, "PATH": f"{STANDIN}:{os.environ['PATH']}"})
    cfg = spec.load(CONF, overrides)
    _prune(CACHE / "images", render.spec_hash(cfg, build.image_code_files(cfg)))
    return overrides


def _prune(images: Path, keep: str, stem: str = CONF.stem) -> None:
    """Older specs' images of config ``stem`` (a GB each): their archive, SIF, record, build directory and podman
    tag."""
    for record in images.glob(f"{stem}-*.json"):
        h = record.stem.rsplit("-", 1)[1]
        if h == keep:
            continue
        tag = (json.loads(record.read_text()) or {}).get("tag")
        if tag:
            subprocess.run(["podman", "rmi", "--force", tag], capture_output=True, timeout=300, check=False)
        for f in (record.with_suffix(".tar"), record.with_suffix(".sif"), record):
            f.unlink(missing_ok=True)
        shutil.rmtree(images / "build" / record.stem, ignore_errors=True)


@pytest.fixture(scope="module")
@fixture_tier("local")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The same config with runtime none, run on this machine: the weights every containerized run must end with."""
    root = tmp_path_factory.mktemp("reference")
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(CONF), "scheduler=local",
                          "container.runtime=none", f"run_root={root}", *BASE, "model.step_time_s=0"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = root.glob("slurm-2node-podman-*")
    return final_weights(run)


def cluster_env(cluster: devcluster.Cluster) -> dict[str, str]:
    return {**os.environ, **cluster.env(), "OMP_NUM_THREADS": "1"}


def submit_run(env: dict[str, str], root: Path, *overrides: str) -> Path:
    runner(env, "submit", str(CONF), f"run_root={root}", *BASE, "alerts.enabled=false", *overrides, timeout=180)
    [run] = root.glob("slurm-2node-podman-*")
    return run


def ranks(run: Path) -> list[dict[str, Any]]:
    files = sorted((run / "ranks").glob("rank-*.json"))
    assert len(files) == 4, files
    return [json.loads(f.read_text()) for f in files]


def assert_same_weights(run: Path, reference: list[Any]) -> None:
    import torch

    assert (run / "finished").exists()
    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)


def test_podman_trains_inside_is_preempted_resumes_bitwise(slurm_cluster: devcluster.Cluster,
                                                           image_overrides: list[str], reference: list[Any],
                                                           tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    data = tmp_path / "data"  # outside the image, listed in container.binds, read by the preflight inside
    data.mkdir()
    (data / "shard-0").write_text("x")
    run = submit_run(env, tmp_path / "runs", *image_overrides, f"container.binds=[{data}]",
                     f"preflight.paths=[{data}]", "env.NCCL_IB_TIMEOUT=22")
    manifest = json.loads((run / "manifest.json").read_text())
    cfg = spec.load(CONF, image_overrides)
    assert manifest["runtime"] == "podman" and manifest["image"] == build.image_path(cfg)
    assert manifest["spec_hash"] == render.spec_hash(cfg, build.image_code_files(cfg))

    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 240, run)
    first = job_id(run)
    # The preemption notice goes to the batch shell only; it must reach every rank inside the containers.
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists(), 300, run)
    assert_same_weights(run, reference)

    attempt1 = sorted((run / "logs" / "attempt-1").glob("rank-*.log"))
    assert len(attempt1) == 4 and all("received SIGUSR2" in f.read_text() for f in attempt1)
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert exits[0]["exit_code"] == 75, exits  # every rank checkpointed on the signal
    assert "requeued" in [e["event"] for e in events(run)]  # by the host-side hook (the image has no scontrol)
    assert [e["event"] for e in events(run)].count("train_start") == 2
    for r in ranks(run):
        assert (r["runtime"], r["image"], r["in_container"]) == ("podman", manifest["image"], True), r
        assert r["image_spec_hash"] == manifest["spec_hash"]
        assert r["slurm"]["SLURM_JOB_ID"] == first and r["slurm"]["SLURM_NTASKS"] == "4", r
        assert r["omp_num_threads"] == "1"
    assert sorted({r["hostname"] for r in ranks(run)}) == ["n1", "n2"]
    envj = json.loads((run / "env.json").read_text())["vars"]
    assert envj["MASTER_ADDR"]["value"] == "n1" and envj["MASTER_PORT"]["value"].isdigit()
    assert envj["GLOO_SOCKET_IFNAME"]["source"].startswith("detected")  # from the route, inside the container
    assert envj["NCCL_IB_TIMEOUT"]["value"] == "22"
    preflight = json.loads((run / "preflight.json").read_text())
    seen = {(c["node"], c["status"]) for c in preflight["checks"] if c["name"] == "path" and c["value"] == str(data)}
    assert {s for _, s in seen} == {"pass"} and len(seen) == 2, preflight["checks"]
    assert list((run / "checkpoints").glob("step-*/COMPLETE"))  # written through the bind


def test_apptainer_standin_killed_rank_is_resubmitted_by_cron(slurm_cluster: devcluster.Cluster,
                                                               image_overrides: list[str], reference: list[Any],
                                                               tmp_path: Path) -> None:
    # sbatch passes the submitter's PATH to the job (PATH is not the config's to set): srun finds `apptainer`, the
    # stand-in, on it, for the first job and for cron's resubmission alike.
    env = {**cluster_env(slurm_cluster), "PATH": f"{STANDIN}:{SYSTEM_PATH}"}
    run = submit_run(env, tmp_path / "runs", *image_overrides, "container.runtime=apptainer")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 300, run)
    for r in ranks(run):
        assert (r["runtime"], r["in_container"]) == ("apptainer", True), r
        assert r["image"].endswith(".sif")
    os.kill(ranks(run)[3]["pid"], signal.SIGKILL)  # the stand-in shares the host's PID namespace, as Apptainer
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 90, run)
    out = runner(env, "cron", "--root", str(tmp_path / "runs")).stdout
    assert "resubmit:" in out, out
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists(), 300, run)
    assert_same_weights(run, reference)


def test_stale_image_fails_in_seconds_and_build_from_run_gives_the_same_spec(image_overrides: list[str],
                                                                              tmp_path: Path) -> None:
    """The rank reads the image's spec hash (/etc/runner-spec.json) and the run's (manifest): another image stops
    the job at once, naming both. `runner build --from-run` rebuilds the run's own spec."""
    p = submit.plan(CONF, [f"run_root={tmp_path}", *image_overrides])
    submit.write(p)
    run = p.run.root
    dry = subprocess.run([sys.executable, "-m", "runner", "build", "--from-run", str(run), "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    manifest = json.loads((run / "manifest.json").read_text())
    assert f"spec hash:   {manifest['spec_hash']}" in dry.stdout.splitlines(), dry.stdout + dry.stderr
    assert "is up to date" in dry.stdout  # the cached image is that spec's

    image = manifest["image"]
    manifest["spec_hash"] = "0123456789ab"  # as if the tag now held another build
    (run / "manifest.json").write_text(json.dumps(manifest))
    t0 = time.monotonic()
    out = subprocess.run(["podman", "run", "--rm", "--network=host", "--volume", f"{run}:{run}", "--env", "RANK=0",
                          "--env", "WORLD_SIZE=1", "--env", "MASTER_ADDR=127.0.0.1", "--env", "MASTER_PORT=29999",
                          image, "python3", "-m", "runner.job.launch", str(run)],
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    log = (run / "logs" / "attempt-1" / "rank-00000.log").read_text()
    assert out.returncode == 77, out.stderr + log
    have = json.loads(subprocess.run(["podman", "run", "--rm", image, "cat", "/etc/runner-spec.json"],
                                     capture_output=True, text=True, timeout=60, check=True).stdout)["spec_hash"]
    assert f"found image spec {have}; expected spec 0123456789ab" in log
    assert json.loads((run / "preflight.json").read_text())["summary"].startswith("stale image: image ")
    assert took < 30, took


def test_pyxis_script_is_accepted_by_sbatch(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    """pyxis cannot run here: its batch script passes shellcheck (test_runtimes) and sbatch --test-only."""
    cfg = spec.load(REPO / "conf" / "slurm-2node.yaml", ["container.runtime=pyxis", f"run_root={tmp_path}"],
                    run_dir=str(tmp_path / "run"))
    script = tmp_path / "job.sbatch"
    script.write_text(render.sbatch(cfg, tmp_path / "run", str(tmp_path / "img.sqsh")))
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60,
                         env=cluster_env(slurm_cluster))
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr
    assert f"--container-image={tmp_path / 'img.sqsh'}" in script.read_text()
