"""`runner parallel` with ESPnet3's provider/runner classes: a provider class builds each worker's environment
(``build_worker_setup_fn``), a runner class's static ``forward`` runs per item, as the seed writes them
(``runner = MyRunner(MyProvider(cfg)); runner(range(n))``). Real Dask workers; with ESPnet3 installed
(scripts/install-espnet3.sh), also subclasses of ESPnet3's own ``EnvironmentProvider`` and ``BaseRunner``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from runner.host import parallel as driver
from runner.parallel.store import Store
from runner.rundir import RunDir
from tests.ci import unavailable
from tests.test_parallel import wait_for_chunks

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
ESPNET3_PYTHON = REPO / ".venv-espnet3" / "bin" / "python"
ITEMS = 10000


def config(tmp_path: Path, **parallel: object) -> Path:
    doc = {"name": "classes", "run_root": str(tmp_path / "runs"), "container": {"runtime": "none"},
           "parallel": {"env": "local", "n_workers": 2, "options": {"threads_per_worker": 1},
                        "provider": {"_target_": "runner.dev.stats.StatsProvider",
                                     "config": {"num_samples": ITEMS, "dim": 16}},
                        "forward": "runner.dev.stats.StatsRunner", "reduce": "runner.dev.stats.reduce",
                        "items": ITEMS, "chunk_size": 250, **parallel}}
    path = tmp_path / "classes.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def runner(python: Path | str, *args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "runner", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def plain_loop() -> object:
    """What the seed's own lines compute in one process: ``MyRunner(MyProvider(cfg))(range(n))``, reduced."""
    from runner.dev import stats

    values = stats.StatsRunner(stats.StatsProvider({"num_samples": ITEMS, "dim": 16}))(range(ITEMS))
    return stats.reduce(values)


@pytest.mark.local
def test_provider_and_runner_classes_equal_a_plain_loop_every_item_once_after_a_kill(tmp_path: Path) -> None:
    conf = config(tmp_path, chunk_size=100)
    conf_slow = ["parallel.provider.config.sleep_s=0.0005"]
    run = driver.plan(conf, conf_slow).run
    first = subprocess.Popen([sys.executable, "-m", "runner", "parallel", str(conf), *conf_slow],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_chunks(run, 3, first)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    done = sum(1 for _ in Store(run).items())
    assert 0 < done < ITEMS

    out = runner(sys.executable, "parallel", str(conf), *conf_slow)  # the rerun continues the same run directory
    assert out.returncode == 0, out.stderr
    assert [i for i, _ in Store(run).items()] == list(range(ITEMS))  # every item once
    starts = [e for e in run.events() if e["event"] == "start"]
    assert starts[-1]["items_left"] == ITEMS - done
    assert json.loads(Store(run).result.read_text()) == plain_loop()


@pytest.mark.parametrize(("override", "key", "needle"), [
    ("parallel.forward=runner.dev.stats.StatsRunnr", "parallel.forward", "no class or function 'StatsRunnr'"),
    ("parallel.forward=runner.dev.stats.StatsRunner.fwd", "parallel.forward", "class StatsRunner has no 'fwd'"),
    ("parallel.forward=runner.dev.stats.StatsProvider", "parallel.forward", "class StatsProvider has no 'forward'"),
    ("parallel.provider._target_=runner.dev.stats.StatsRunner", "parallel.provider._target_",
     "class StatsRunner has none of build_worker_setup_fn"),
])
def test_dry_run_catches_a_class_that_cannot_work(tmp_path: Path, override: str, key: str, needle: str) -> None:
    out = runner(sys.executable, "parallel", str(config(tmp_path)), "--dry-run", override)
    assert out.returncode == 2, out.stdout + out.stderr
    assert key in out.stderr and needle in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_dry_run_accepts_the_class_pair_and_the_method_path(tmp_path: Path) -> None:
    for forward in ("runner.dev.stats.StatsRunner", "runner.dev.stats.StatsRunner.forward"):
        out = runner(sys.executable, "parallel", str(config(tmp_path)), "--dry-run", f"parallel.forward={forward}")
        assert out.returncode == 0, out.stderr
        assert f"workload:      {forward} over {ITEMS} items, provider runner.dev.stats.StatsProvider" in out.stdout


ESPNET3_WORKLOAD = '''
"""collect_stats' shape written on ESPnet3's own classes (a subclass of each)."""
from espnet3.parallel.base_runner import BaseRunner
from espnet3.parallel.env_provider import EnvironmentProvider

from runner.dev import stats


class FeatsProvider(EnvironmentProvider):
    def build_env_local(self):
        return stats.provider(num_samples=self.config.num_samples, dim=self.config.dim)

    def build_worker_setup_fn(self):
        n, dim = self.config.num_samples, self.config.dim
        return lambda: stats.provider(num_samples=n, dim=dim)


class FeatsRunner(BaseRunner):
    @staticmethod
    def forward(idx, feats, **env):
        return stats.forward(idx, feats)
'''


@pytest.mark.local
def test_subclasses_of_espnet3s_own_provider_and_runner(tmp_path: Path) -> None:
    if not ESPNET3_PYTHON.exists():
        unavailable("ESPnet3's venv is missing: run scripts/install-espnet3.sh")
    (tmp_path / "feats_workload.py").write_text(textwrap.dedent(ESPNET3_WORKLOAD))
    conf = config(tmp_path, provider={"_target_": "feats_workload.FeatsProvider",
                                      "config": {"num_samples": ITEMS, "dim": 16}},
                  forward="feats_workload.FeatsRunner.forward")
    dry = runner(ESPNET3_PYTHON, "parallel", str(conf), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    out = runner(ESPNET3_PYTHON, "parallel", str(conf))
    assert out.returncode == 0, out.stderr
    run = RunDir(next((tmp_path / "runs").iterdir()))
    assert [i for i, _ in Store(run).items()] == list(range(ITEMS))
    assert json.loads(Store(run).result.read_text()) == plain_loop()


def test_a_provider_that_cannot_build_fails_the_run_once_not_once_per_item(tmp_path: Path) -> None:
    out = runner(sys.executable, "parallel", str(config(tmp_path)), "parallel.provider.config.bogus=1")
    assert out.returncode == 1, out.stderr
    assert "the workload could not start in a worker" in out.stderr and "bogus" in out.stderr
    assert "item 0:" not in out.stderr and "Traceback" not in out.stderr
