"""Training inside the image on the real dev cluster (2 nodes x 2 ranks, CPU/gloo): real podman, and real Apptainer
(built from its Go module source by scripts/install-apptainer.sh) running the SIF that `runner build` makes.

The training image is built once per test session, offline, from a wheelhouse made on this machine (torch 2.13.0,
lightning, runner's own wheel) and the local Debian base; both are cached across sessions by content hash
(the wheelhouse by what its wheels are made of, the image by its spec hash) under /var/tmp/runner-test-cache. A change
to runner's code alone keeps the wheelhouse, so podman finds the pip layer (5 GB) in its cache and only the layer of
the code `container.code` copies is new.

Few full runs, each asserting much: every run costs minutes of CPU shared with other test sessions.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
CACHE = Path("/var/tmp/runner-test-cache")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_TIMEOUT_S = 1200
# The training image's pip line, the same in every image the tests build on the Debian base (program mode's too):
# the same line on the same base is one layer in podman's storage (5 GB with PyPI's CUDA torch), not one per image.
IMAGE_PIP = ["torch==2.13.0", "lightning==2.6.*", "torchdata==0.11.0", "runner[train]"]


def _wheels_key() -> str:
    """What the wheelhouse's wheels are made of: runner's dependencies and the script. Not runner's code: the image
    runs the checkout's runner, which ``container.code`` copies in after the pip layer (PYTHONPATH before the
    site-packages, where the wheelhouse's runner wheel, perhaps older than the checkout, lies unused), so a change
    to the code alone finds the 5 GB pip layer in podman's cache instead of reinstalling it."""
    h = hashlib.sha256()
    for f in [REPO / "pyproject.toml", REPO / "containers" / "wheelhouse.sh"]:
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
    building (or finding) the podman image and the SIF of that spec."""
    if os.geteuid() != 0 or shutil.which("apptainer") is None:
        unavailable("the container tests need root, podman and Apptainer. HINT: scripts/install-podman.sh; "
                    "scripts/install-apptainer.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    wheelhouse = CACHE / f"wheelhouse-{_wheels_key()}"
    for old in CACHE.glob("wheelhouse-*"):  # not the ESPnet3 image's (tests/test_espnet3_podman.py keeps its own)
        if old != wheelhouse and not old.name.endswith(".tmp") and not old.name.startswith("wheelhouse-espnet3-"):
            shutil.rmtree(old, ignore_errors=True)
    _run([str(REPO / "containers" / "wheelhouse.sh"), str(wheelhouse)], "containers/wheelhouse.sh",
         env={**os.environ, "PYTHON": sys.executable})
    # zstd: the SIF of this 5 GB image in 2 min instead of 8 (gzip) on 2 cores, at the same size (BENCHMARKS.md)
    overrides = [f"container.wheelhouse={wheelhouse}", f"container.image_dir={CACHE / 'images'}",
                 f"container.pip={json.dumps(IMAGE_PIP)}", "container.sif_compression=zstd"]
    cfg = spec.load(CONF, overrides)
    cli = [sys.executable, "-m", "runner", "build", str(CONF), *overrides]
    _run(cli, "runner build (podman)")
    _run([*cli, "container.runtime=apptainer"], "runner build (the SIF)")
    _prune(CACHE / "images", render.spec_hash(cfg, build.image_code_files(cfg)))
    return overrides


def _prune(images: Path, keep: str, stem: str = CONF.stem) -> None:
    """Other specs' images of config ``stem`` (GBs each), once this spec's is built: their archive, SIF, record,
    build directory (a failed build's too) and podman tag, then the layers no image uses any more. Never before the
    build: the old image holds the 5 GB pip layer a code change leaves as it is, and podman's cache finds it only
    while some image still uses it (pruned first, every CI after a code change rebuilt ESPnet3's image whole)."""
    if not images.is_dir():
        return
    for d in [*images.glob(f"{stem}-*.json"), *(images / "build").glob(f"{stem}-*")]:
        name = d.name.removesuffix(".json")
        if name.rsplit("-", 1)[1] == keep:
            continue
        tag = f"localhost/runner-{stem}:{name.rsplit('-', 1)[1]}"
        subprocess.run(["podman", "rmi", "--force", tag], capture_output=True, timeout=300, check=False)
        for f in (images / f"{name}.tar", images / f"{name}.sif", images / f"{name}.json"):
            f.unlink(missing_ok=True)
        shutil.rmtree(images / "build" / name, ignore_errors=True)
    subprocess.run(["podman", "image", "prune", "--force"], capture_output=True, timeout=300, check=False)


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


def preempt_and_resume(env: dict[str, str], run: Path, reference: list[Any]) -> str:
    """A USR2 notice at step 20 to the batch shell only: it must reach every rank inside the containers, each rank
    checkpoints (exit 75), the host-side hook requeues (the image has no scontrol) and the run ends bitwise equal to
    runtime none. Returns the first job's id."""
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 300, run)
    first = job_id(run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists(), 300, run)
    assert_same_weights(run, reference)
    attempt1 = sorted((run / "logs" / "attempt-1").glob("rank-*.log"))
    assert len(attempt1) == 4 and all("received SIGUSR2" in f.read_text() for f in attempt1)
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert exits[0]["exit_code"] == 75, exits
    assert "requeued" in [e["event"] for e in events(run)]
    return first


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

    first = preempt_and_resume(env, run, reference)
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


def apptainer(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["apptainer", *args], capture_output=True, text=True, timeout=300, check=check)


def sif_of(image_overrides: list[str]) -> Path:
    return Path(build.image_path(spec.load(CONF, [*image_overrides, "container.runtime=apptainer"])))


def container_processes(sif: Path) -> list[str]:
    """Processes of a container of this SIF still alive: Apptainer's starter names the image in its command line,
    and every process inside has its /.singularity.d (their root is the image's)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(sif) in line or "Apptainer runtime parent" in line]


def test_the_sif_is_real_apptainer_with_runner_labels_and_its_test_ran(image_overrides: list[str]) -> None:
    sif = sif_of(image_overrides)
    cfg = spec.load(CONF, [*image_overrides, "container.runtime=apptainer"])
    h = render.spec_hash(cfg, build.image_code_files(cfg))
    assert apptainer("version").stdout.strip() == "1.5.3"  # the binary scripts/install-apptainer.sh built
    partitions = apptainer("sif", "list", str(sif)).stdout
    assert "Def.FILE" in partitions and "FS (Squashfs/*System/amd64)" in partitions, partitions
    squashfs = subprocess.run(["unsquashfs", "-s", "-o", str(fs_range(sif)[0]), str(sif)], capture_output=True,
                              text=True, timeout=60).stdout  # container.sif_compression
    assert "Compression zstd\n\tcompression-level 3\n" in squashfs, squashfs
    labels = apptainer("inspect", "--labels", str(sif)).stdout
    assert f"runner.spec_hash: {h}" in labels.splitlines() and f"runner.version: {render.__version__}" in labels
    assert "runner.git_commit: " in labels
    logs = sif.parent / "build" / f"{CONF.stem}-{h}" / "logs"
    assert "runner " in (logs / "test.log").read_text()  # %test ran the image's launcher (`--version`)
    # Inside: the image's own environment scripts ran, the host's files are not there unless bound.
    out = apptainer("exec", str(sif), "sh", "-c", "echo $PYTHONPATH $APPTAINER_CONTAINER; ls /.singularity.d/env")
    assert out.stdout.startswith(f"/workspace {sif}\n") and "90-environment.sh" in out.stdout, out.stdout


def test_apptainer_trains_inside_is_preempted_and_resumes_bitwise(slurm_cluster: devcluster.Cluster,
                                                                  image_overrides: list[str], signing: list[str],
                                                                  reference: list[Any], tmp_path: Path) -> None:
    """The srun line as rendered, with real `apptainer exec` of the signed SIF: each job verifies its signature
    first; a USR2 notice reaches every rank through Apptainer's starter, the host-side hook requeues (the image has
    no scontrol), the run resumes bitwise equal to runtime none; no container process outlives the job."""
    env = cluster_env(slurm_cluster)
    sif = sif_of(image_overrides)
    run = submit_run(env, tmp_path / "runs", *signing, "env.NCCL_IB_TIMEOUT=22")
    preempt_and_resume(env, run, reference)
    pub = next(o.split("=", 1)[1] for o in signing if o.startswith("container.verify_key="))
    said = "".join(f.read_text(errors="replace") for f in run.rglob("*.out"))
    assert said.count(f"image {sif}: its signature verifies with {pub}") == 2, said[-3000:]  # both jobs
    for r in ranks(run):
        # in_container: runner's image with its Python, /.singularity.d and the starter's APPTAINER_CONTAINER
        assert (r["runtime"], r["image"], r["in_container"]) == ("apptainer", str(sif), True), r
        assert r["apptainer_container"] == str(sif)
        assert r["slurm"]["SLURM_NTASKS"] == "4" and r["omp_num_threads"] == "1", r
    assert sorted({r["hostname"] for r in ranks(run)}) == ["n1", "n2"]
    envj = json.loads((run / "env.json").read_text())["vars"]
    assert envj["MASTER_ADDR"]["value"] == "n1" and envj["NCCL_IB_TIMEOUT"]["value"] == "22"
    assert envj["GLOO_SOCKET_IFNAME"]["source"].startswith("detected")
    wait_for("the job's containers to be gone", lambda: not container_processes(sif), 30, run)


def test_apptainer_killed_rank_is_resubmitted_by_cron(slurm_cluster: devcluster.Cluster, image_overrides: list[str],
                                                     reference: list[Any], tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    sif = sif_of(image_overrides)
    run = submit_run(env, tmp_path / "runs", *image_overrides, "container.runtime=apptainer")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 300, run)
    os.kill(ranks(run)[3]["pid"], signal.SIGKILL)  # Apptainer shares the host's PID namespace by default
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 90, run)
    assert "rank 3 on n2: killed" in status(env, run)["last_cause"]
    wait_for("the job's containers to be gone", lambda: not container_processes(sif), 30, run)
    out = runner(env, "cron", "--root", str(tmp_path / "runs")).stdout
    assert "resubmit:" in out, out
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists(), 300, run)
    assert_same_weights(run, reference)
    wait_for("the job's containers to be gone", lambda: not container_processes(sif), 30, run)


def test_apptainer_stopped_rank_is_named_with_its_node(slurm_cluster: devcluster.Cluster,
                                                       image_overrides: list[str], tmp_path: Path) -> None:
    """A rank SIGSTOPped inside its container (a hung kernel, as the ranks see it): the others' watchdogs name it and
    its node, the job ends as a hang, and no container process outlives it (Slurm kills the stopped one too)."""
    env = cluster_env(slurm_cluster)
    sif = sif_of(image_overrides)
    run = submit_run(env, tmp_path / "runs", *image_overrides, "container.runtime=apptainer", "watchdog.floor_s=5")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 300, run)
    victim = ranks(run)[3]
    os.kill(victim["pid"], signal.SIGSTOP)  # the rank's own process: Apptainer shares the host's PID namespace
    wait_for("the hang to be named", lambda: any(e["event"] == "exit" and e["outcome"] == "hang"
                                                 for e in events(run)), 120, run)
    row = status(env, run)
    assert row["last_outcome"] == "hang" and f"rank 3 on {victim['hostname']}" in row["last_cause"], row
    hang = json.loads((run / "hang.json").read_text())
    assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(3, victim["hostname"])], hang
    wait_for("the job's containers to be gone", lambda: not container_processes(sif), 60, run)


@pytest.fixture(scope="session")
def signing(image_overrides: list[str]) -> list[str]:
    """A key pair kept beside the cached images, and the cached SIF signed with it in place: `runner build` with
    container.sign_key finds the SIF of the spec built and only adds the signature. Overrides that sign and verify."""
    keys = CACHE / "keys"
    if not (keys / "key.pub").is_file():
        keys.mkdir(exist_ok=True)
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(keys / "key.pem")], check=True)
        subprocess.run(["openssl", "pkey", "-in", str(keys / "key.pem"), "-pubout", "-out", str(keys / "key.pub")],
                       check=True)
    overrides = [*image_overrides, "container.runtime=apptainer", f"container.sign_key={keys / 'key.pem'}",
                 f"container.verify_key={keys / 'key.pub'}"]
    out = _run([sys.executable, "-m", "runner", "build", str(CONF), *overrides], "runner build (sign the SIF)")
    assert "[1/1] sign: sign the SIF" in out or "is up to date" in out, out  # never a rebuild
    return overrides


def tiny_sif(d: Path, name: str) -> Path:
    """A SIF of a few KB (one file in its root filesystem): enough for a signature check, which runs before any rank
    and never looks inside."""
    root = d / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hello").write_text("hello\n")
    sif = d / name
    apptainer("build", "--disable-cache", str(sif), str(root))
    return sif


def fs_range(sif: Path) -> tuple[int, int]:
    """Where the SIF's root filesystem (a squashfs) lies in the file: its first and last byte offsets."""
    [fs] = [line.split("|") for line in apptainer("sif", "list", str(sif)).stdout.splitlines() if "|FS " in line]
    start, end = (int(x) for x in fs[3].strip().split("-"))
    return start, end


def flip_a_byte_of_the_root_filesystem(sif: Path) -> None:
    start, end = fs_range(sif)
    with sif.open("r+b") as f:
        f.seek((start + end) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def test_a_changed_or_unsigned_sif_is_refused_before_any_rank_starts(
        slurm_cluster: devcluster.Cluster, signing: list[str], image_overrides: list[str], tmp_path: Path) -> None:
    """With container.verify_key every job verifies its SIF on the batch host before srun: an unsigned SIF and a
    signed one with one byte of its root filesystem changed end the job with exit 77, the reason in preflight.json,
    and no rank started. (The training test signs and verifies the real image: the job that passes.)"""
    key = next(o.split("=", 1)[1] for o in signing if o.startswith("container.sign_key="))
    pub = next(o.split("=", 1)[1] for o in signing if o.startswith("container.verify_key="))
    name = sif_of(image_overrides).name  # named for the spec, so submit takes it without a record
    (tmp_path / "unsigned").mkdir()
    (tmp_path / "changed").mkdir()
    unsigned = tiny_sif(tmp_path / "unsigned", name)
    changed = tiny_sif(tmp_path / "changed", name)
    apptainer("sign", "--key", key, str(changed))
    assert apptainer("verify", "--key", pub, str(changed)).returncode == 0
    flip_a_byte_of_the_root_filesystem(changed)
    env = cluster_env(slurm_cluster)
    cases = {"changed": (changed, "data object integrity compromised"), "unsigned": (unsigned, "signature not found")}
    for what, (image, why) in cases.items():
        run = submit_run(env, tmp_path / f"{what}-runs", *signing, f"container.image={image}")
        wait_for(f"the {what} image to be refused", lambda run=run: status(env, run)["state"] == "failed", 90, run)
        exits = [e for e in events(run) if e["event"] == "exit"]
        assert exits and exits[-1]["exit_code"] == 77, exits
        assert "train_start" not in [e["event"] for e in events(run)]
        summary = json.loads((run / "preflight.json").read_text())["summary"]
        assert summary.startswith(f"image signature: {image} does not verify with {pub}") and why in summary, summary
        assert not list((run / "ranks").glob("rank-*.json"))  # no rank started


@pytest.fixture
def world_readable_tmp() -> Iterator[Path]:
    """A directory another user can reach (pytest's own are root's, mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="runner-nobody-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_an_unprivileged_user_runs_a_rank_of_the_sif(image_overrides: list[str], world_readable_tmp: Path) -> None:
    """HPC users are not root: as `nobody`, Apptainer (installed without setuid) takes a user namespace and mounts
    the SIF with squashfuse; one rank of the image reads its bound run directory and writes a checkpoint there."""
    sif = sif_of(image_overrides)
    cfg_overrides = [*image_overrides, "container.runtime=apptainer", f"run_root={world_readable_tmp / 'runs'}",
                     "num_nodes=1", "num_device=1", "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                     "model.step_time_s=0", "alerts.enabled=false"]
    p = submit.plan(CONF, cfg_overrides)
    submit.write(p)
    run = p.run.root
    subprocess.run(["chown", "-R", "nobody:nogroup", str(world_readable_tmp / "runs")], check=True)
    home = world_readable_tmp / "home"
    home.mkdir()
    shutil.chown(home, "nobody", "nogroup")
    argv = ["apptainer", "exec", "--bind", f"{run.parent}:{run.parent}", "--env", "RANK=0", "--env", "WORLD_SIZE=1",
            "--env", "LOCAL_RANK=0", "--env", "MASTER_ADDR=127.0.0.1", "--env", "MASTER_PORT=29517",
            "--env", "OMP_NUM_THREADS=1", str(sif), "python3", "-m", "runner.job.launch", str(run)]
    out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", *argv],
                         capture_output=True, text=True, timeout=300, env={"PATH": SYSTEM_PATH, "HOME": str(home)})
    log = (run / "logs" / "attempt-1" / "rank-00000.log")
    assert out.returncode == 0, out.stdout + out.stderr + (log.read_text() if log.exists() else "")
    assert checkpoint_done(run, 4)
    written = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert written.stat().st_uid == pwd.getpwnam("nobody").pw_uid  # by the user, through the bind
    rank = json.loads((run / "ranks" / "rank-00000.json").read_text())
    assert rank["in_container"] is True and rank["apptainer_container"] == str(sif)


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
