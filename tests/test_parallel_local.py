"""`runner parallel` on real Dask with local worker processes (the local tier; the plan and the store:
tests/test_parallel.py)."""

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

from runner.host import parallel as driver
from runner.parallel.store import Store
from runner.rundir import RunDir
from runner.spec import load
from tests.test_parallel import CONF, REPO, _env, _problems, indices, run_of, runner, start, wait_for_chunks
from tests.webhook_server import WebhookServer

pytestmark = pytest.mark.local


def status(run: RunDir) -> dict[str, Any]:
    out = runner("status", str(run.root), "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    return dict(row)


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


def test_one_driver_per_run(tmp_path: Path) -> None:
    p = driver.plan(CONF, [f"run_root={tmp_path}"])
    store = Store(p.run)
    with driver._one_driver(store):
        assert store.driver_alive()
        out = runner("parallel", str(CONF), f"run_root={tmp_path}")
        assert out.returncode == 1 and "another `runner parallel`" in out.stderr
    assert not store.driver_alive()


def test_a_parallel_block_next_to_trainer_validates() -> None:
    cfg = load(REPO / "conf" / "quickstart.yaml", ["parallel.env=local_gpu", "parallel.n_workers=4"])
    assert cfg.data["parallel"]["n_workers"] == 4
    plain = load(REPO / "conf" / "quickstart.yaml")
    assert cfg.hash() == plain.hash()  # the parallel block is not part of the training trajectory
    assert any("parallel: found 'strategy'" in p for p in _problems(Path(), ["parallel.strategy=ddp"], "train"))
    out = runner("validate", str(CONF))
    assert out.returncode == 2 and "hint: run it with `runner parallel" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_validate_and_dry_run_never_import_dask(tmp_path: Path) -> None:
    code = ("import sys; from runner import cli; "
            "cli.main(['validate', 'conf/quickstart.yaml', 'parallel.env=slurm']); "
            f"cli.main(['parallel', 'conf/parallel-stats.yaml', 'run_root={tmp_path}', '--dry-run']); "
            "bad = [m for m in ('dask', 'distributed', 'dask_jobqueue') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "10000 left" in out.stdout


def test_without_the_parallel_extra_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Dask is absent from this Python (as without `runner[parallel]`): one line naming the extra, exit 1 (what
    is missing is the setup, not the input)."""
    code = ("import sys; sys.modules['distributed'] = None; from runner import cli; "
            f"sys.exit(cli.main(['parallel', 'conf/parallel-stats.yaml', 'run_root={tmp_path}']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "found no `distributed`" in out.stderr and "pip install 'runner[parallel]'" in out.stderr


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
