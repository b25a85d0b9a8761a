"""ESPnet3's own mini_an4 recipe (``espnet==202611`` from PyPI, its ``run.py`` and config unchanged) under runner,
as examples/espnet3-mini-an4/README.md runs it: every stage a runner run, training on the dev cluster (2 nodes x 2
ranks, CPU/gloo, ``runtime: none`` with the ESPnet3 venv), and the faults runner promises to handle, inside ESPnet3's
own Lightning Trainer. One training run inside the podman variant's image (``prepare.sh --podman``): Python 3.12 on
the stand-in base of containers/test-base-py312.sh, built offline once per session from
containers/wheelhouse-espnet3.sh's wheels; both are cached under /var/tmp/runner-test-cache (the wheelhouse by its
sources, the image by runner's spec hash).

Here the recipe and its stages run locally; the training on the dev cluster is in tests/test_espnet3_cluster.py, the
one inside the podman image in tests/test_espnet3_podman.py.

Needs ``.venv-espnet3`` (scripts/install-espnet3.sh, which scripts/test.sh runs): skipped with a reason on a laptop
without it, a failure under CI=true."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from runner import checkpoint
from runner.rundir import EXIT_PREFLIGHT
from tests.ci import unavailable
from tests.conftest import fixture_tier
from tests.test_failures import checkpoint_done, events, status, wait_for
from tests.test_program_cluster import exits

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


@pytest.fixture(scope="session")  # prepared once for this file, _cluster and _podman
@fixture_tier("local")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe prepared as the README says: create_dataset, then train_tokenizer and collect_stats, each a
    one-process runner run (local)."""
    espnet3_python()
    work = tmp_path_factory.mktemp("espnet3") / "mini_an4"
    prep = subprocess.run([str(EXAMPLE / "prepare.sh"), str(work)], capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    for n, stages in enumerate(["create_dataset", "[train_tokenizer, collect_stats]"]):
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
    conf = template_with_runner_settings(tmp_path)
    (tmp_path / "run.py").write_text("")  # validate runs in the recipe, beside its run.py, as the README has it
    out = subprocess.run([sys.executable, "-m", "runner", "validate", str(conf), *overrides], capture_output=True,
                         text=True, env=local_env(), cwd=tmp_path, timeout=120)
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


# -- every stage, locally ------------------------------------------------------------------------------------------


def assert_the_preflight_found_espnet3(run: Path) -> None:
    """The preflight names the ranks' Python (the ESPnet3 venv's) and found what run.py imports."""
    [python] = [c for c in json.loads((run / "preflight.json").read_text())["checks"] if c["name"] == "python"]
    assert (python["status"], python["value"], python["threshold"]) == ("pass", str(PYTHON), "finds espnet3"), python


@pytest.mark.local
def test_runners_own_python_is_refused_by_the_preflight_in_one_line(tmp_path: Path) -> None:
    """The quickstart's .venv (no espnet3) as the ranks' Python: the preflight names it and the line of run.py that
    imports espnet3 (was: a pass, then ModuleNotFoundError on every rank ~10 s later); the run waits for a person."""
    espnet3_python()
    work = tmp_path / "mini_an4"
    prep = subprocess.run([str(EXAMPLE / "prepare.sh"), str(work)], capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    out = subprocess.run([sys.executable, "-m", "runner", "submit", CONF, f"runner.run_root={tmp_path / 'runs'}",
                          "stages=create_dataset"], capture_output=True, text=True, cwd=work, env=local_env(),
                         timeout=300)
    assert out.returncode == EXIT_PREFLIGHT, out.stdout + out.stderr
    missing = f"{sys.executable} cannot find espnet3, which run.py:1 imports: `from espnet3."
    run = one_run(tmp_path / "runs")
    [python] = [c for c in json.loads((run / "preflight.json").read_text())["checks"] if c["name"] == "python"]
    assert python["status"] == "fail" and python["value"].startswith(missing), python
    [line] = [ln for ln in (run / "logs" / "attempt-1" / "rank-00000.log").read_text().splitlines() if " ERROR " in ln]
    assert f"preflight: {missing}" in line and "hint: run the ranks with the Python that has" in line, line
    assert "Traceback" not in out.stdout + out.stderr and [e["outcome"] for e in exits(run)] == ["preflight_failed"]


@pytest.mark.local
def test_the_whole_recipe_reaches_a_wer_in_espnet3s_own_metrics(recipe: Path, tmp_path: Path) -> None:
    """After the prep stages (the ``recipe`` fixture: each a runner run, ESPnet3's outputs where ESPnet3 puts them),
    `train` on 2 ranks for 11 epochs (ESPnet3 then averages its 10 best checkpoints, the model prepare.sh points
    inference at), then `infer` and `measure` as one run with the example's command, as its README has it: ESPnet3's
    metrics.json holds a WER and a CER for both test sets, from this training's averaged model."""
    for n in ("0", "1"):
        run = one_run(recipe / "prep-runs" / n)
        assert (run / "finished").exists() and [e["outcome"] for e in exits(run)] == ["completed"]
        assert_the_preflight_found_espnet3(run)
    assert (recipe / "data" / "manifest" / "train.tsv").exists()
    assert (recipe / "exp" / "stats" / "train" / "feats_shape").exists()  # collect_stats, on ESPnet3's Dask
    runs = tmp_path / "runs"
    out = submit(recipe, local_env(), runs, "stages=train", "num_device=2", "trainer.max_epochs=11", "exp_tag=to_wer")
    assert out.returncode == 0, out.stdout + out.stderr
    [train] = runs.iterdir()
    assert (train / "finished").exists()
    assert_the_preflight_found_espnet3(train)
    # ESPnet3's experiment, named as ESPnet3 names it, its own checkpoints and its validation loss in its log.
    exp = recipe / "exp" / "to_wer"
    assert (exp / "last.ckpt").exists() and list(exp.glob("epoch*valid.loss.ckpt"))
    assert "valid/loss" in (exp / "train.log").read_text()
    assert (train / "program" / "training_asr_transformer.yaml").exists()
    assert status(local_env(), train)["state"] == "completed"
    out = submit(recipe, local_env(), runs, "stages=[infer, measure]", "exp_tag=to_wer")
    assert out.returncode == 0, out.stdout + out.stderr
    [score] = [r for r in runs.iterdir() if r != train]
    metrics = json.loads((exp / "inference" / "metrics.json").read_text())
    for name, key in (("wer.WER", "WER"), ("cer.CER", "CER")):
        scores = metrics[f"espnet3.systems.esp2_asr.metrics.{name}"]
        assert sorted(scores) == ["test", "valid"], metrics
        assert all(isinstance(s[key], (int, float)) and s[key] >= 0 for s in scores.values()), metrics
    log = (score / "logs" / "attempt-1" / "rank-00000.log").read_text()
    assert "exp/to_wer/valid.loss.ave_10best.pth" in log  # the model this training averaged, not a 1-step file
    assert (exp / "valid.loss.ave_10best.pth").exists()
    # `runner status` shows the recipe's stages together, oldest first, each with its state.
    shown = subprocess.run([str(espnet3_python()), "-m", "runner", "status", "--root", str(runs)], capture_output=True,
                           text=True, env=local_env(), timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"recipe {recipe}: train completed, infer measure completed" in shown.stdout, shown.stdout
    assert f"{train.name}  [train]" in shown.stdout and f"{score.name}  [infer measure]" in shown.stdout


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
    stop = checkpoint.complete(run / "checkpoints")[0][0]
    resumed = subprocess.run([str(espnet3_python()), "-m", "runner", "resume", str(run), "num_device=1"],
                             capture_output=True, text=True, env=local_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resized from 1x2 (accumulate 1) to 1x1 (accumulate 2); 2 rank-batches per optimizer step kept" \
        in resumed.stdout, resumed.stdout
    program = yaml.safe_load((run / "program" / "training_asr_transformer.yaml").read_text())
    assert (program["num_device"], program["trainer"]["accumulate_grad_batches"]) == (1, 2)
    starts = [e for e in events(run) if e["event"] == "train_start"]
    # ESPnet3's loader is replayed to a stop's batch on the layout that wrote the checkpoint only: on 1 rank each
    # rank's share of the epoch is other utterances, so the resume goes back to the epoch's start, the checkpoint runner
    # wrote at its end (8 steps an epoch), and trains the interrupted epoch again, each batch once.
    assert [s["attempt"] for s in starts] == [1, 2] and starts[1]["step"] == stop // 8 * 8, (stop, starts)
    assert starts[1]["resumed_from"].endswith(f"step-{starts[1]['step']:07d}")
    assert [e["accumulate"] for e in events(run) if e["event"] == "resized"] == [2]
    # The global batch runner measured in ESPnet3's Trainer: 2 ranks x 2 per rank, then 1 rank x 2 x accumulation 2.
    assert [(e["global_batch"], e["local_batch"]) for e in events(run) if e["event"] == "data"] == [(4, 2), (4, 2)]
    [said] = [e for e in events(run) if e["event"] == "resumed"]
    assert (said["from_world"], said["to_world"], said["from_accumulate"], said["to_accumulate"]) == (2, 1, 1, 2)
    # The record says which: "restarted" and the steps trained again when the stop was mid-epoch (where the signal
    # found the ranks), "whole" when it was at an epoch's end.
    mid_epoch = stop % 8 != 0
    assert (said["mid_epoch"], said["data_exact"]) == (False, True), said
    assert (said["partial_epoch"], said["steps_again"]) == (("restarted", stop % 8) if mid_epoch else ("whole", None))
    # Every epoch whole, on 1 rank as on 2 (Lightning alone would carry the 8 batches a rank had taken into the next
    # epoch and end it halfway): as many steps as the unpreempted run.
    finished = next(e for e in events(run) if e["event"] == "finished")["step"]
    assert finished == epochs * 8, (finished, starts)


# -- training on the dev cluster -----------------------------------------------------------------------------------

def squeue(env: dict[str, str], *args: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.split()


# A dev-cluster node has 1 GB (RealMemory=1024); a worker holding ESPnet3 and torch uses about 790 MB, past Dask's
# pause at 80% of its 0.93 GiB limit: a loaded CI once saw the surviving worker pause for good and never take the
# cancelled worker's shard. Dask's own memory limit is off in these workers (its last --memory-limit wins);
# Slurm's --mem still holds.
NO_PAUSE = "'--memory-limit', '0'"


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
