"""ESPnet3's own mini_an4 recipe (``espnet==202611`` from PyPI, its ``run.py`` and config unchanged) under runner,
as examples/espnet3-mini-an4/README.md runs it: every stage a runner run, training on the dev cluster (2 nodes x 2
ranks, CPU/gloo, ``runtime: none`` with the ESPnet3 venv), and the faults runner promises to handle, inside ESPnet3's
own Lightning Trainer. One training run inside the podman variant's image (``prepare.sh --podman``): Python 3.12 on
the stand-in base of containers/test-base-py312.sh, built offline once per session from
containers/wheelhouse-espnet3.sh's wheels; both are cached under /var/tmp/runner-test-cache (the wheelhouse by its
sources, the image by runner's spec hash).

Needs ``.venv-espnet3`` (scripts/install-espnet3.sh, which scripts/test.sh runs): skipped with a reason on a laptop
without it, a failure under CI=true."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from runner.dev import devcluster
from tests import test_containers
from tests.ci import unavailable
from tests.conftest import fixture_tier
from tests.test_failures import checkpoint_done, events, job_id, runner, status, wait_for
from tests.test_program_cluster import cluster_env, exits
from tests.test_program_cluster import ranks as rank_info

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "espnet3-mini-an4"
PYTHON = REPO / ".venv-espnet3" / "bin" / "python"
CONF = "conf/training_asr_transformer.yaml"
REPEAT = 8  # 32 training utterances: 4 batches of 2 per rank and epoch on 4 ranks; 8 for validation: 1 per rank
EPOCHS = 25  # 100 steps on 4 ranks
TRAIN = ["stages=train", "num_nodes=2", "num_device=2", "runner.scheduler=slurm", f"trainer.max_epochs={EPOCHS}",
         "trainer.limit_train_batches=null", "trainer.limit_val_batches=null", "trainer.log_every_n_steps=4",
         "runner.network.pg_timeout_s=60", "runner.resume.backoff_s=0", "runner.alerts.enabled=false"]


def espnet3_python() -> Path:
    if not PYTHON.exists():
        unavailable("ESPnet3's venv is missing. HINT: scripts/install-espnet3.sh")
    return PYTHON


def submit(recipe: Path, env: dict[str, str], root: Path, *overrides: str, timeout: float = 900, conf: str = CONF
           ) -> subprocess.CompletedProcess[str]:
    """``runner submit`` from the ESPnet3 venv, in the recipe directory, as the example's README does."""
    return subprocess.run([str(espnet3_python()), "-m", "runner", "submit", conf, f"runner.run_root={root}",
                           *overrides], capture_output=True, text=True, cwd=recipe, env=env, timeout=timeout)


def local_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def one_run(root: Path) -> Path:
    [run] = root.iterdir()
    return run


@pytest.fixture(scope="module")
@fixture_tier("local")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe prepared as the README says: create_dataset, then train_tokenizer and collect_stats, each a
    one-process runner run (local)."""
    espnet3_python()
    work = tmp_path_factory.mktemp("espnet3") / "mini_an4"
    prep = subprocess.run([str(EXAMPLE / "prepare.sh"), str(work)], capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    for n, stages in enumerate(["create_dataset", "train_tokenizer collect_stats"]):
        out = submit(work, local_env(), work / "prep-runs" / str(n), f"stages={stages}")
        assert out.returncode == 0, out.stdout + out.stderr
        if stages == "create_dataset":
            repeat = subprocess.run([str(PYTHON), str(EXAMPLE / "repeat.py"), "data/manifest", str(REPEAT)],
                                    cwd=work, capture_output=True, text=True, timeout=60)
            assert repeat.returncode == 0, repeat.stderr
    return work


# -- the config ----------------------------------------------------------------------------------------------------


def template_with_runner_settings(tmp_path: Path) -> Path:
    """ESPnet3's TEMPLATE training.yaml with runner's settings added the documented way: it has num_nodes and
    num_device already, so the rest of examples/espnet3-mini-an4/runner.yaml."""
    template = subprocess.run([str(espnet3_python()), "-c", "import egs3, os; print(os.path.join(os.path.dirname("
                               "egs3.__file__), 'TEMPLATE', 'esp2_asr', 'conf', 'training.yaml'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    settings = [line for line in (EXAMPLE / "runner.yaml").read_text().splitlines()
                if not line.startswith(("num_nodes:", "num_device:"))]
    path = tmp_path / "training.yaml"
    path.write_text(Path(template).read_text() + "\n".join(settings) + "\n")
    return path


@pytest.mark.parametrize(("overrides", "key"), [
    ([], None),
    (["num_device=2"], "dataloader.train.dist_world_size"),  # ESPnet3's dist_world_size: 1 left as it was
    (["num_device=2", "dataloader.train.dist_world_size=2", "dataloader.valid.dist_world_size=2",
      "dataloader.train.total_shards=3", "dataloader.valid.total_shards=2"], "dataloader.train.total_shards"),
])
def test_runner_validates_espnet3s_template_config(tmp_path: Path, overrides: list[str], key: str | None) -> None:
    out = runner(local_env(), "validate", str(template_with_runner_settings(tmp_path)), *overrides, check=False)
    if key is None:
        assert out.returncode == 0, out.stderr
        resolved = yaml.safe_load(out.stdout)
        assert resolved["program"]["scheduler"]["_target_"] == "espnet2.schedulers.warmup_lr.WarmupLR"  # ESPnet3's
        assert resolved["scheduler"] == "local" and resolved["program"]["exp_tag"] == "${self_name:}"
        return
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()  # one line a problem (train and valid both, where both are wrong)
    assert lines[0].startswith("runner: error:") and key in lines[0] and len(lines) <= 2, lines
    assert "Traceback" not in out.stderr


@pytest.mark.unit
def test_the_podman_variant_installs_the_packages_of_the_requirements_file() -> None:
    """podman.yaml names the packages, containers/espnet3-requirements.txt their versions (the wheelhouse holds one
    of each): the two lists stay the same, plus runner's own wheel."""
    lines = (REPO / "containers" / "espnet3-requirements.txt").read_text().splitlines()
    required = [re.split(r"[=<>!~ ]", line, maxsplit=1)[0] for line in lines if line and not line.startswith("#")]
    podman = yaml.safe_load("runner:\n" + (EXAMPLE / "podman.yaml").read_text())["runner"]["container"]
    assert podman["pip"] == [*required, "runner[train]"]
    assert podman["runtime"] == "podman" and podman["python"] == "python3.12"


# -- every stage, locally ------------------------------------------------------------------------------------------


@pytest.mark.local
def test_the_stages_run_as_runner_runs_and_espnet3s_outputs_are_where_espnet3_puts_them(recipe: Path,
                                                                                      tmp_path: Path) -> None:
    for n in ("0", "1"):
        run = one_run(recipe / "prep-runs" / n)
        assert (run / "finished").exists() and [e["outcome"] for e in exits(run)] == ["completed"]
    assert (recipe / "data" / "manifest" / "train.tsv").exists()
    assert (recipe / "exp" / "stats" / "train" / "feats_shape").exists()  # collect_stats, on ESPnet3's Dask
    out = submit(recipe, local_env(), tmp_path / "runs", "stages=train", "num_device=2", "trainer.max_epochs=2",
                 "exp_tag=local_train")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    assert (run / "finished").exists()
    # ESPnet3's experiment, named as ESPnet3 names it, its own checkpoints and its validation loss in its log.
    exp = recipe / "exp" / "local_train"
    assert (exp / "last.ckpt").exists() and list(exp.glob("epoch*valid.loss.ckpt"))
    assert "valid/loss" in (exp / "train.log").read_text()
    assert (run / "program" / "training_asr_transformer.yaml").exists()
    row = status(local_env(), run)
    assert row["state"] == "completed", row


@pytest.mark.local
def test_a_resume_on_fewer_ranks_keeps_espnet3s_global_batch(recipe: Path, tmp_path: Path) -> None:
    """Stopped on 2 ranks, resumed on 1 (`runner resume RUN num_device=1`): runner writes the layout into ESPnet3's
    own config (num_device; dist_world_size where it is written) with accumulate_grad_batches 2, so an optimizer
    step still takes 2 per-rank batches; ESPnet3 continues from the stop's checkpoint, and the global batch runner
    measures in its Trainer is the same."""
    epochs = 8  # 32 utterances, 2 per rank-batch: 8 optimizer steps an epoch on 2 ranks, and on 1 rank with 2
    proc = subprocess.Popen([str(espnet3_python()), "-m", "runner", "submit", CONF, f"runner.run_root={tmp_path}",
                             "stages=train", "num_device=2", f"trainer.max_epochs={epochs}", "exp_tag=resized",
                             "trainer.limit_train_batches=null", "trainer.limit_val_batches=null"],
                            cwd=recipe, env=local_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for("the submit to make its run", lambda: any(tmp_path.iterdir()), 120)
    run = one_run(tmp_path)
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10) or proc.poll() is not None, 600, run)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out
    resumed = subprocess.run([str(espnet3_python()), "-m", "runner", "resume", str(run), "num_device=1"],
                             capture_output=True, text=True, env=local_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resized from 1x2 (accumulate 1) to 1x1 (accumulate 2); 2 rank-batches per optimizer step kept" \
        in resumed.stdout, resumed.stdout
    program = yaml.safe_load((run / "program" / "training_asr_transformer.yaml").read_text())
    assert (program["num_device"], program["trainer"]["accumulate_grad_batches"]) == (1, 2)
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert [s["attempt"] for s in starts] == [1, 2] and starts[1]["step"] >= 10, starts
    assert starts[1]["resumed_from"].endswith(f"step-{starts[1]['step']:07d}")
    assert [e["accumulate"] for e in events(run) if e["event"] == "resized"] == [2]
    # The global batch runner measured in ESPnet3's Trainer: 2 ranks x 2 per rank, then 1 rank x 2 x accumulation 2.
    assert [(e["global_batch"], e["local_batch"]) for e in events(run) if e["event"] == "data"] == [(4, 2), (4, 2)]
    [said] = [e for e in events(run) if e["event"] == "resumed"]
    assert (said["from_world"], said["to_world"], said["from_accumulate"], said["to_accumulate"]) == (2, 1, 1, 2)
    # ESPnet3's loader cannot resume mid-epoch: the resume says so, and the replayed batches are steps on top. The
    # stop lands where the signal finds the ranks (8 steps an epoch): at an epoch's end the next epoch starts whole.
    mid_epoch = starts[1]["step"] % 8 != 0
    assert (said["mid_epoch"], said["data_exact"]) == (mid_epoch, not mid_epoch), said
    assert ("replays the epoch" if mid_epoch else "at the epoch's end") in said["data"], said
    assert next(e for e in events(run) if e["event"] == "finished")["step"] >= epochs * 8


# -- training on the dev cluster -----------------------------------------------------------------------------------

cluster = pytest.mark.slurm


@cluster
def test_train_stage_on_two_nodes_of_two_ranks(slurm_cluster: devcluster.Cluster, recipe: Path,
                                               tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_train", "trainer.max_epochs=3")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("the training job to end", lambda: bool(exits(run)), 600, run)
    [end] = exits(run)
    assert (end["outcome"], end["exit_code"]) == ("completed", 0), end
    info = rank_info(run)
    assert sorted(r["hostname"] for r in info) == ["n1", "n1", "n2", "n2"]
    assert {r["runtime"] for r in info} == {"none"}
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == 3 * 4  # ESPnet3's global step
    exp = recipe / "exp" / "cluster_train"
    assert (exp / "last.ckpt").exists() and "valid/loss" in (exp / "train.log").read_text()
    assert status(env, run)["state"] == "completed"


@cluster
def test_a_preemption_notice_requeues_and_espnet3s_global_step_continues(slurm_cluster: devcluster.Cluster,
                                                                         recipe: Path, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_usr2")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    first = job_id(run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: len(exits(run)) == 2, 600, run)
    first_exit, second_exit = exits(run)
    assert (first_exit["outcome"], first_exit["exit_code"]) == ("preempted", 75), first_exit
    assert second_exit["outcome"] == "completed", second_exit
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert [s["attempt"] for s in starts] == [1, 2]
    stop = starts[1]["step"]
    assert 10 <= stop < EPOCHS * 4 and starts[0]["step"] == 0  # not from 0 again: from the stop's checkpoint
    assert starts[1]["resumed_from"].endswith(f"step-{stop:07d}")
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == EPOCHS * 4
    log = (run / "logs" / "attempt-1" / "rank-00000.log").read_text()
    assert re.search(rf"stopped on signal at step {stop}\b", log), log[-2000:]


@cluster
def test_a_killed_rank_is_resubmitted_by_cron_and_finishes(slurm_cluster: devcluster.Cluster, recipe: Path,
                                                           tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_kill")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    os.kill(rank_info(run)[3]["pid"], signal.SIGKILL)
    wait_for("the job to fail", lambda: bool(exits(run)) and status(env, run)["state"] == "failed", 120, run)
    cron = runner(env, "cron", "--root", str(tmp_path / "runs")).stdout
    assert "resubmit:" in cron, cron
    wait_for("the resubmitted job to finish", lambda: len(exits(run)) == 2, 600, run)
    assert exits(run)[1]["outcome"] == "completed" and (run / "finished").exists()
    starts = [e["step"] for e in events(run) if e["event"] == "train_start"]
    assert starts[0] == 0 and starts[1] >= 10, starts


@cluster
def test_a_stopped_rank_is_named_as_the_hang(slurm_cluster: devcluster.Cluster, recipe: Path, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_hang", "runner.watchdog.floor_s=5",
                 "runner.resume.enabled=false")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    victim = rank_info(run)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wait_for("the hang to be recorded", lambda: bool(exits(run)), 180, run)
        [end] = exits(run)
        assert (end["outcome"], end["exit_code"]) == ("hang", 79), end
        hang = json.loads((run / "hang.json").read_text())
        assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(1, victim["hostname"])], hang
    finally:
        os.kill(victim["pid"], signal.SIGCONT) if Path(f"/proc/{victim['pid']}").exists() else None
        runner(env, "cancel", str(run), check=False)


def squeue(env: dict[str, str], *args: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.split()


# A dev-cluster node has 1 GB (RealMemory=1024); a worker holding ESPnet3 and torch uses about 790 MB, past Dask's
# pause at 80% of its 0.93 GiB limit: a loaded CI once saw the surviving worker pause for good and never take the
# cancelled worker's shard. Dask's own memory limit is off in these workers (its last --memory-limit wins);
# Slurm's --mem still holds.
NO_PAUSE = "'--memory-limit', '0'"


@cluster
def test_collect_stats_on_slurm_worker_jobs_one_cancelled_equals_local(slurm_cluster: devcluster.Cluster,
                                                                       recipe: Path, tmp_path: Path) -> None:
    """ESPnet3's own parallel: block with env: slurm: its dask-jobqueue workers are Slurm jobs on the dev cluster
    (started from the stage's own job, with runner's environment); one is cancelled as it starts its shard, and the
    statistics still equal those of env: local (the recipe fixture's, one worker): the shape files and frame counts
    byte for byte, the float32 sums up to their summation order (2 shards here, 1 there)."""
    env = cluster_env(slurm_cluster)
    stats = recipe / "exp" / "stats_slurm"
    out = submit(recipe, env, tmp_path / "runs", "stages=collect_stats", "runner.scheduler=slurm",
                 "parallel.env=slurm", "parallel.n_workers=2", f"stats_dir={stats}", "exp_tag=stats_slurm",
                 "parallel.options={cores: 1, memory: 1000MB, processes: 1, walltime: '00:20:00', "
                 f"worker_extra_args: [{NO_PAUSE}]}}")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    victim = cancel_a_worker_mid_way(env, run, stats)
    state = subprocess.run(["sacct", "-n", "-X", "-j", victim, "-o", "State"], capture_output=True, text=True,
                           env=env, timeout=30).stdout
    assert "CANCELLED" in state, state
    assert_same_stats(stats, recipe / "exp" / "stats")


def cancel_a_worker_mid_way(env: dict[str, str], run: Path, stats: Path,
                            seen: Callable[[], bool] = lambda: True) -> str:
    """Once a worker job has started a shard of train (and ``seen`` holds), scancel one worker job; the stage's job
    then ends completed. Returns the cancelled job's id."""
    wait_for("a worker job to start a shard", lambda: bool(squeue(env, "-n", "dask-worker", "-t", "R", "-o", "%i"))
             and bool(list(stats.glob("train/split.*/lock"))) and seen(), 300, run)
    assert len(list(stats.glob("train/split.*/done"))) < 2  # mid-way: not every shard of train is done
    victim = squeue(env, "-n", "dask-worker", "-t", "R", "-o", "%i")[0]
    subprocess.run(["scancel", victim], env=env, check=True, timeout=30)
    wait_for("the stage's job to end", lambda: bool(exits(run)), 600, run)
    [end] = exits(run)
    assert (end["outcome"], end["exit_code"]) == ("completed", 0), end
    return victim


def assert_same_stats(stats: Path, local: Path) -> None:
    """ESPnet3's statistics equal env: local's: the shape files and frame counts byte for byte, the float32 sums up
    to their summation order."""
    import numpy as np

    for name in ("train/feats_shape", "train/text_shape", "valid/feats_shape"):
        assert (stats / name).read_bytes() == (local / name).read_bytes(), name
    for split in ("train", "valid"):
        mine, ref = np.load(stats / split / "feats_stats.npz"), np.load(local / split / "feats_stats.npz")
        assert sorted(mine.files) == sorted(ref.files) and int(mine["count"]) == int(ref["count"]) > 0
        for key in ref.files:
            np.testing.assert_allclose(mine[key], ref[key], rtol=1e-5, err_msg=f"{split} {key}")


# -- training inside the podman image ------------------------------------------------------------------------------

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
    key = hashlib.sha256(test_containers._source_key().encode() + b"".join(
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
    test_containers._prune(cache / "images", spec_hash[1], stem="mini-an4")  # before: the disk is not endless
    _image_step(build, "runner build (the ESPnet3 podman image)", cwd=work)
    return work / CONF


@pytest.mark.podman
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
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == 3 * 4  # ESPnet3's global step
    exp = recipe / "exp" / "podman_train"
    assert (exp / "last.ckpt").exists() and list(exp.glob("epoch*valid.loss.ckpt"))
    assert "valid/loss" in (exp / "train.log").read_text()
    assert status(env, run)["state"] == "completed"


@pytest.mark.podman
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
