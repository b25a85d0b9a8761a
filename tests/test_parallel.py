"""ESPnet3's ``parallel:`` layer (`runner parallel`) on real Dask: local worker processes, and Slurm worker jobs
from dask-jobqueue on the dev cluster. The example workload is runner.dev.stats (collect_stats' shape).

Here the plan, the config and the store; the runs are in tests/test_parallel_local.py and
tests/test_parallel_cluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.host import parallel as driver
from runner.parallel import plan as P
from runner.parallel.store import Store
from runner.rundir import RunDir
from runner.spec import load
from tests.waiting import until
from tests.webhook_server import WebhookServer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "parallel-stats.yaml"


def _env(webhook: WebhookServer | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if webhook is not None:
        env["RUNNER_WEBHOOK_URL"] = webhook.url
    return env


def runner(*args: str, webhook: WebhookServer | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(webhook), cwd=REPO)


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runner", "parallel", str(CONF), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)


def run_of(tmp_path: Path, *overrides: str) -> RunDir:
    return driver.plan(CONF, [f"run_root={tmp_path}", *overrides]).run


def indices(run: RunDir) -> list[int]:
    return [i for i, _ in Store(run).items()]


def wait_for_chunks(run: RunDir, n: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    def written() -> bool:
        if len(list(Store(run).chunks.glob("chunk-*.json"))) >= n:
            return True
        assert proc.poll() is None, proc.communicate()
        return False
    until(f"{n} chunks", written, timeout, every=0.1)


# -- the plan and the config ------------------------------------------------------------------------------------


def test_chunks_cover_every_item_once() -> None:
    for n, size in ((0, 5), (1, 5), (10, 5), (11, 5), (10000, 250)):
        items = [i for c in P.chunks(n, size) for i in c.items]
        assert items == list(range(n))
    assert P.todo(P.Chunk(2, 10, 15), {10: 1, 12: 2}) == [11, 13, 14]


def test_run_directory_follows_the_workload_not_where_it_runs(tmp_path: Path) -> None:
    base = run_of(tmp_path)
    assert run_of(tmp_path, "parallel.n_workers=8", "parallel.env=slurm").root == base.root
    assert run_of(tmp_path, "parallel.provider.dim=8").root != base.root
    assert run_of(tmp_path, "parallel.chunk_size=7").root != base.root


def test_local_gpu_pins_one_gpu_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    assert P.worker_envs("local_gpu", 4, 2, ["0", "1", "3"]) == [
        {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": g} for g in ("0", "1", "3")]
    assert P.worker_envs("local", 2, 1, []) == [{"OMP_NUM_THREADS": "1"}] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert driver.visible_gpus() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(Exception, match="no visible GPU"):
        driver.plan(CONF, ["parallel.env=local_gpu"])


def test_slurm_workers_run_like_training_jobs(tmp_path: Path) -> None:
    p = driver.plan(CONF, [f"run_root={tmp_path}", "parallel.env=slurm", "slurm.partition=dev", "slurm.time=00:20:00",
                           "parallel.options.memory=2GB", "env.MY_VAR=a b"])
    kw = p.cluster_kwargs
    assert (kw["queue"], kw["walltime"], kw["memory"], kw["cores"], kw["processes"]) == \
        ("dev", "00:20:00", "2GB", 1, 1)
    assert kw["python"] == sys.executable  # container.runtime none: the exec prefix of the training job
    assert kw["log_directory"] == str(p.run.logs / "workers")
    assert "export MY_VAR='a b'" in kw["job_script_prologue"]
    assert "SLURMCluster" in str(p) and "2 Slurm worker jobs" in str(p)
    boxed = driver.plan(CONF, [f"run_root={tmp_path}", "parallel.env=slurm", "container.runtime=apptainer",
                               "container.image=/img/x.sif", "container.allow_missing_image=true"]).cluster_kwargs
    assert boxed["python"].startswith("apptainer exec --nv --bind ")  # the same runtime and binds as training
    assert str(tmp_path) in boxed["python"] and boxed["python"].endswith(" python")


def _problems(tmp_path: Path, overrides: list[str], kind: str = "parallel") -> list[str]:
    with pytest.raises(ConfigError) as e:
        load(CONF if kind == "parallel" else REPO / "conf" / "quickstart.yaml", overrides, kind=kind)
    return e.value.problems


@pytest.mark.parametrize(("overrides", "key", "needle"), [
    (["parallel.env=cloud"], "parallel.env", "one of local, local_gpu, slurm"),
    (["parallel.options.queues=gpu"], "parallel.options.queues", "an option of Dask (local) or dask-jobqueue"),
    (["parallel.env=slurm", "parallel.options.queue=gpu;reboot"], "parallel.options.queue", "shell characters"),
    (["parallel.forward=null"], "parallel.forward", "forward(idx, **env)"),
    (["parallel.forward=runner.dev.stats.nope"], "parallel.forward", "'nope'"),
    (["parallel.provider._target_=runner.dev.stats.NoSuchProvider"], "parallel.provider._target_", "NoSuchProvider"),
    (["parallel.n_workers=0"], "parallel.n_workers", ">= 1"),
    (["parallel.options.num_nodes=2"], "parallel", "trainer settings under trainer:"),
    (["env.BAD;rm=1"], "env.BAD;rm", "environment variable name"),
])
def test_parallel_config_errors_name_their_key(tmp_path: Path, overrides: list[str], key: str, needle: str) -> None:
    found = _problems(tmp_path, overrides)
    line = next((p for p in found if f": {key}: " in p), None)
    assert line is not None and needle in line, found
    assert all("\n" not in p for p in found)
