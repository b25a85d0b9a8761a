"""ESPnet3's ``parallel:`` layer (`runner parallel`) on real Dask: local worker processes, and Slurm worker jobs
from dask-jobqueue on the dev cluster. The example workload is runner.dev.stats (collect_stats' shape)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def status(run: RunDir) -> dict[str, Any]:
    out = runner("status", str(run.root), "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    return dict(row)


def wait_for_chunks(run: RunDir, n: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    def written() -> bool:
        if len(list(Store(run).chunks.glob("chunk-*.json"))) >= n:
            return True
        assert proc.poll() is None, proc.communicate()
        return False
    until(f"{n} chunks", written, timeout, every=0.1)


# -- local ------------------------------------------------------------------------------------------------------


@pytest.mark.local
def test_local_example_equals_a_plain_loop_and_a_rerun_does_nothing(tmp_path: Path, webhook: WebhookServer) -> None:
    from runner.dev import stats

    out = runner("parallel", str(CONF), f"run_root={tmp_path}", webhook=webhook)
    assert out.returncode == 0, out.stderr
    run = run_of(tmp_path)
    env = stats.provider(num_samples=10000, dim=16)
    plain = stats.reduce(stats.forward(i, **env) for i in range(10000))
    assert json.loads(Store(run).result.read_text()) == plain
    assert indices(run) == list(range(10000))  # every item once
    assert "progress:" in out.stderr  # periodic lines when stderr is not a terminal
    row = status(run)
    assert (row["state"], row["items_done"], row["items_failed"]) == ("completed", 10000, 0)
    [alert] = webhook.wait_for(1)
    assert "completed" in json.dumps(alert) and run.name in json.dumps(alert)
    again = runner("parallel", str(CONF), f"run_root={tmp_path}")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert run.attempts() == [1]
    assert "done: 10000 items" in runner("logs", str(run.root)).stdout


@pytest.mark.local
def test_cancel_or_kill_midway_then_rerun_does_every_item_exactly_once(tmp_path: Path) -> None:
    slow = [f"run_root={tmp_path}", "parallel.items=2000", "parallel.provider.num_samples=2000",
            "parallel.provider.sleep_s=0.004", "parallel.chunk_size=50"]
    run = run_of(tmp_path, *slow)
    first = start(*slow)
    wait_for_chunks(run, 3, first)
    out = runner("cancel", str(run.root))
    assert out.returncode == 0 and "cancelled" in out.stdout, out.stderr
    assert first.wait(60) == 130
    row = status(run)
    assert row["state"] == "cancelled" and 0 < row["items_done"] < 2000, row

    second = start(*slow)  # lifts the cancel, continues; then dies without a word
    wait_for_chunks(run, len(list(Store(run).chunks.glob("chunk-*.json"))) + 3, second)
    second.send_signal(signal.SIGKILL)
    second.wait(30)
    row = status(run)
    assert row["state"] == "failed" and "driver is gone" in row["last_cause"], row
    done_before = row["items_done"]

    resumed = runner("resume", str(run.root))  # the same as `runner parallel CONF` again
    assert resumed.returncode == 0, resumed.stderr
    starts = [e for e in run.events() if e["event"] == "start"]
    assert starts[-1]["items_left"] == 2000 - done_before  # the rerun skipped what was done
    assert indices(run) == list(range(2000))
    assert status(run)["state"] == "completed"


@pytest.mark.local
def test_failed_items_are_retried_then_listed_with_their_error(tmp_path: Path, webhook: WebhookServer) -> None:
    bad = [f"run_root={tmp_path}", "parallel.items=400", "parallel.provider.num_samples=400",
           "parallel.provider.fail=[3,377]", "parallel.provider.flaky=[5,10,399]", "parallel.retries=1"]
    out = runner("parallel", str(CONF), *bad, webhook=webhook)
    assert out.returncode == 1, out.stderr
    assert "2 items failed after 1 retries" in out.stderr
    assert "item 3: ValueError: item 3 is broken" in out.stderr and "item 377:" in out.stderr
    run = run_of(tmp_path, *bad)
    assert Store(run).summary()[1] == {3: "ValueError: item 3 is broken", 377: "ValueError: item 377 is broken"}
    assert indices(run) == [i for i in range(400) if i not in (3, 377)]  # flaky items succeeded on their retry
    assert not Store(run).result.exists()  # no reduce over an incomplete set
    row = status(run)
    assert (row["state"], row["items_done"], row["items_failed"]) == ("failed", 398, 2)
    [alert] = webhook.wait_for(1)
    assert "failed" in json.dumps(alert) and "item 3" in json.dumps(alert)
    again = runner("parallel", str(CONF), *bad)  # a rerun tries only the failed items again
    assert again.returncode == 1
    assert [e for e in run.events() if e["event"] == "start"][-1]["items_left"] == 2


@pytest.mark.local
def test_one_driver_per_run(tmp_path: Path) -> None:
    p = driver.plan(CONF, [f"run_root={tmp_path}"])
    store = Store(p.run)
    with driver._one_driver(store):
        assert store.driver_alive()
        out = runner("parallel", str(CONF), f"run_root={tmp_path}")
        assert out.returncode == 1 and "another `runner parallel`" in out.stderr
    assert not store.driver_alive()


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


@pytest.mark.local
def test_a_parallel_block_next_to_trainer_validates() -> None:
    cfg = load(REPO / "conf" / "quickstart.yaml", ["parallel.env=local_gpu", "parallel.n_workers=4"])
    assert cfg.data["parallel"]["n_workers"] == 4
    plain = load(REPO / "conf" / "quickstart.yaml")
    assert cfg.hash() == plain.hash()  # the parallel block is not part of the training trajectory
    assert any("parallel: found 'strategy'" in p for p in _problems(Path(), ["parallel.strategy=ddp"], "train"))
    out = runner("validate", str(CONF))
    assert out.returncode == 2 and "hint: run it with `runner parallel" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.local
def test_validate_and_dry_run_never_import_dask(tmp_path: Path) -> None:
    code = ("import sys; from runner import cli; "
            "cli.main(['validate', 'conf/quickstart.yaml', 'parallel.env=slurm']); "
            f"cli.main(['parallel', 'conf/parallel-stats.yaml', 'run_root={tmp_path}', '--dry-run']); "
            "bad = [m for m in ('dask', 'distributed', 'dask_jobqueue') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "10000 left" in out.stdout


@pytest.mark.local
def test_without_the_parallel_extra_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Dask is absent from this Python (as without `runner[parallel]`): one line naming the extra, exit 1 (what
    is missing is the setup, not the input)."""
    code = ("import sys; sys.modules['distributed'] = None; from runner import cli; "
            f"sys.exit(cli.main(['parallel', 'conf/parallel-stats.yaml', 'run_root={tmp_path}']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "found no `distributed`" in out.stderr and "pip install 'runner[parallel]'" in out.stderr


# -- Slurm (real dask-jobqueue on the dev cluster) -----------------------------------------------------------------


def _jobs(name: str, *flags: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i", *flags], capture_output=True, text=True, timeout=10)
    return out.stdout.split()


@pytest.mark.slurm
def test_slurm_worker_jobs_one_cancelled_midway_every_item_once(slurm_cluster: Any, tmp_path: Path) -> None:
    args = [f"run_root={tmp_path}", "parallel.env=slurm", "parallel.n_workers=2", "parallel.items=2000",
            "parallel.provider.num_samples=2000", "parallel.provider.sleep_s=0.005", "parallel.chunk_size=50",
            f"slurm.partition={slurm_cluster.partition}", "slurm.time=00:10:00"]
    run = run_of(tmp_path, *args)
    name = driver.plan(CONF, args).cluster_kwargs["job_name"]
    proc = start(*args)
    def two_running() -> list[str] | None:  # two worker jobs, each a Slurm job
        if len(jobs := _jobs(name, "-t", "RUNNING")) >= 2:
            return jobs
        assert proc.poll() is None, proc.communicate()
        return None
    running = until("the 2 worker jobs to start", two_running, 120, every=0.2)
    wait_for_chunks(run, 4, proc)
    subprocess.run(["scancel", running[0]], check=True, timeout=10)  # one worker job dies mid-way
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert indices(run) == list(range(2000))  # every item exactly once, though a worker died holding chunks
    assert Store(run).summary() == (2000, {})
    # the driver cancels its other worker job when it is done
    until("the worker jobs to end with the run (none may outlive it)", lambda: not _jobs(name, "-t", "PENDING,RUNNING"),
          30, every=0.5)
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", running[0], "--format=State"], capture_output=True,
                           text=True, timeout=10).stdout
    assert "CANCELLED" in sacct
    assert list((run.logs / "workers").glob("*.err"))  # the worker jobs' own output, in the run directory
    again = runner("parallel", str(CONF), *args)
    assert again.returncode == 0 and "nothing to do" in again.stdout


@pytest.mark.local
def test_local_gpu_workers_each_see_their_own_gpu(tmp_path: Path) -> None:
    """Real Dask workers with env local_gpu: each one's CUDA_VISIBLE_DEVICES holds one of the visible GPUs
    (this machine has none; the pinning is the variable, which is what CUDA reads)."""
    (tmp_path / "gpu_probe.py").write_text(
        "import os, time\n"
        "def forward(idx):\n"
        "    time.sleep(0.01)\n"
        "    return os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    conf = tmp_path / "gpu.yaml"
    conf.write_text(f"run_root: {tmp_path}\nparallel:\n  env: local_gpu\n  n_workers: 2\n"
                    "  forward: gpu_probe.forward\n  items: 200\n  chunk_size: 5\n")
    out = subprocess.run([sys.executable, "-m", "runner", "parallel", str(conf)], capture_output=True, text=True,
                         timeout=120, env={**_env(), "CUDA_VISIBLE_DEVICES": "3,7"}, cwd=REPO)
    assert out.returncode == 0, out.stderr
    [run] = [RunDir(p) for p in tmp_path.glob("gpu-*")]
    seen = [v for _, v in Store(run).items()]
    assert len(seen) == 200 and set(seen) == {"3", "7"}


@pytest.mark.local
def test_a_terminal_gets_a_progress_bar(tmp_path: Path) -> None:
    import pty

    (tmp_path / "tiny.py").write_text("def forward(idx):\n    return idx * idx\n")
    conf = tmp_path / "tiny.yaml"
    conf.write_text(f"run_root: {tmp_path}\nparallel:\n  n_workers: 2\n  forward: tiny.forward\n  items: 300\n"
                    "  chunk_size: 10\n")
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "runner", "parallel", str(conf)], stderr=sub,
                            stdout=subprocess.DEVNULL, env=_env(), cwd=REPO)
    os.close(sub)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the child closed the terminal
        while chunk := os.read(main, 4096):
            seen += chunk
    os.close(main)
    assert proc.wait(60) == 0
    assert b"\r[" in seen and b"300/300 items" in seen
    assert b"progress:" not in seen  # log lines are for files; a terminal gets the bar
