"""The hang watchdog: the analysis as tables (the thread with real processes that really stop advancing:
tests/test_watchdog_local.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner import stragglers
from runner.job.watchdog import phase, rank_hosts, summarize
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

SITE = "/usr/lib/python3/dist-packages"
DDP = f"{SITE}/torch/nn/parallel/distributed.py"
STACKS = [  # (frames outermost first, phase): shapes read from real py-spy / faulthandler dumps of stuck ranks
    ([f"{SITE}/lightning/pytorch/loops/fit_loop.py:run", f"{SITE}/torch/autograd/__init__.py:backward"],
     "backward"),
    ([f"{SITE}/lightning/pytorch/loops/fit_loop.py:run", f"{SITE}/torch/autograd/__init__.py:backward",
      f"{SITE}/torch/distributed/distributed_c10d.py:all_reduce"], "collective"),
    ([f"{SITE}/lightning/pytorch/loops/fetchers.py:__next__", f"{SITE}/torch/utils/data/dataloader.py:_next_data",
      "/home/u/proj/data.py:__getitem__", "/usr/lib/python3.11/time.py:sleep"], "data"),
    ([f"{SITE}/lightning/pytorch/strategies/ddp.py:reduce_boolean_decision"], "collective"),
    # DDP's buffer broadcast before forward (seen on the dev cluster: ESPnet3, a peer SIGSTOPped): a collective.
    ([f"{SITE}/lightning/pytorch/strategies/strategy.py:training_step", f"{DDP}:forward", f"{DDP}:_pre_forward",
      f"{DDP}:_sync_buffers", f"{DDP}:_distributed_broadcast_coalesced"], "collective"),
    ([f"{SITE}/lightning/pytorch/trainer/trainer.py:save_checkpoint", f"{SITE}/torch/serialization.py:save"],
     "checkpoint"),
    ([f"{SITE}/torch/optim/adam.py:step"], "optimizer"),
    (["/home/u/proj/model.py:training_step", "/home/u/proj/model.py:helper"], "forward"),
    (["/home/u/proj/train.py:main"], "other"),
    ([], "other"),
]


@pytest.mark.parametrize(("frames", "expected"), STACKS)
def test_phase_of_a_stack(frames: list[str], expected: str) -> None:
    assert phase(frames) == expected


def _rep(ph: str, host: str = "n1") -> dict[str, str]:
    return {"phase": ph, "host": host, "where": "x.py:f"}


SUMMARIES = [
    # (reports, world, hosts, majority, suspects as (rank, node, state), nodes)
    ({0: _rep("collective"), 1: _rep("collective"), 3: _rep("collective", "n2")}, 4,
     {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, "collective", [(2, "n2", "not responding")], ["n2"]),
    ({0: _rep("collective"), 1: _rep("data"), 2: _rep("collective", "n2"), 3: _rep("collective", "n2")}, 4,
     {}, "collective", [(1, "n1", "in data")], ["n1"]),
    ({0: _rep("data"), 1: _rep("data", "n2"), 2: _rep("collective"), 3: _rep("collective")}, 4,
     {}, "collective", [(0, "n1", "in data"), (1, "n2", "in data")], ["n1", "n2"]),
    ({0: _rep("collective"), 1: _rep("collective")}, 2, {}, "collective", [], []),
    # DDP's gradient all-reduce waits inside backward: ranks in backward and in a collective wait for the same
    # stopped rank, and only that rank is named (seen on the dev cluster with ESPnet3 and rank 1 SIGSTOPped).
    ({0: _rep("collective"), 2: _rep("collective", "n2"), 3: _rep("backward", "n2")}, 4,
     {1: "n1"}, "collective", [(1, "n1", "not responding")], ["n1"]),
    ({0: _rep("backward"), 1: _rep("collective"), 2: _rep("backward", "n2")}, 4,
     {3: "n2"}, "backward", [(3, "n2", "not responding")], ["n2"]),
    ({0: _rep("backward"), 1: _rep("backward"), 2: _rep("data", "n2"), 3: _rep("collective", "n2")}, 4,
     {}, "backward", [(2, "n2", "in data")], ["n2"]),
    ({0: _rep("data"), 1: _rep("data"), 2: _rep("backward", "n2"), 3: _rep("backward", "n2")}, 4,
     {}, "backward", [(0, "n1", "in data"), (1, "n1", "in data")], ["n1"]),
    ({0: _rep("data"), 1: _rep("data"), 2: _rep("backward", "n2"), 3: _rep("collective", "n2")}, 4,
     {}, "collective", [(0, "n1", "in data"), (1, "n1", "in data")], ["n1"]),
    ({0: _rep("forward"), 1: _rep("backward"), 2: _rep("backward", "n2"), 3: _rep("backward", "n2")}, 4,
     {}, "backward", [(0, "n1", "in forward")], ["n1"]),
    ({}, 2, {0: "n1", 1: "n2"}, None, [(0, "n1", "not responding"), (1, "n2", "not responding")], ["n1", "n2"]),
]


@pytest.mark.parametrize(("reports", "world", "hosts", "majority", "suspects", "nodes"), SUMMARIES)
def test_summary_names_the_odd_ranks_and_their_nodes(reports: dict, world: int, hosts: dict, majority: str | None,
                                                      suspects: list, nodes: list) -> None:
    s = summarize(reports, world, hosts)
    assert s["majority"] == majority
    assert [(x["rank"], x["node"], x["state"]) for x in s["suspects"]] == suspects
    assert s["nodes"] == nodes
    for rank, node, _ in suspects:
        assert f"rank {rank} on {node}" in s["summary"]


def test_a_rank_stopped_before_its_first_heartbeat_is_named_with_its_node(tmp_path: Path) -> None:
    """Its node comes from the launcher's record of the rank; another attempt's heartbeat names no node."""
    rd = RunDir(tmp_path)
    for folder, key, rank, host, attempt in (("ranks", "hostname", 0, "n1", 2), ("heartbeats", "host", 0, "n1", 2),
                                             ("ranks", "hostname", 1, "n3", 2), ("heartbeats", "host", 1, "n2", 1),
                                             ("heartbeats", "host", 2, "n2", 1)):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"rank-{rank:05d}.json").write_text(json.dumps({key: host, "attempt": attempt}))
    assert rank_hosts(rd, 2) == {0: "n1", 1: "n3"}
    s = summarize({0: {"phase": "collective"}}, 3, rank_hosts(rd, 2))
    assert [(x["rank"], x["node"]) for x in s["suspects"]] == [(1, "n3"), (2, "?")]


def _beat(rank: int, compute: float, data: float, host: str = "n1") -> dict[str, object]:
    return {"rank": rank, "host": host, "compute_s": compute, "data_s": data, "step": 100}


STRAGGLERS = [
    # (heartbeats, the slow ranks as (rank, what))
    ([_beat(0, .10, .01), _beat(1, .10, .01), _beat(2, .30, .01, "n2"), _beat(3, .11, .01)], [(2, "forward")]),
    ([_beat(0, .10, .01), _beat(1, .10, .20), _beat(2, .10, .01), _beat(3, .10, .01)], [(1, "data")]),
    ([_beat(0, .10, .01), _beat(1, .12, .01), _beat(2, .13, .01)], []),  # within 1.5x
    ([_beat(0, .001, 0), _beat(1, .003, 0)], []),  # 3x but 2 ms: noise
    ([_beat(0, .10, .0), _beat(1, .10, .0), _beat(2, .10, .5)], [(2, "data")]),  # the others never wait
    ([{"rank": 0, "host": "n1"}], []),  # no timings yet
]


@pytest.mark.parametrize(("beats", "slow"), STRAGGLERS)
def test_stragglers_against_the_median(beats: list, slow: list) -> None:
    rows = stragglers.compare(beats)
    assert [(r["rank"], r["slow"]) for r in rows if r["slow"]] == slow
    if slow:
        assert rows[0]["rank"] == slow[0][0]  # slowest first
        assert f"{slow[0][1]}" in stragglers.table(rows).splitlines()[1]


DESCRIBE = [  # a ledger `straggler` record -> the alert's cause
    ({"rank": 2, "node": "n2", "slow": "forward", "step": 40, "compute_x": 6.1, "compute_s": 0.122, "data_x": 1.0},
     "straggler: rank 2 on n2 is 6.1x the median in forward (122 ms vs 20 ms per step), "
     "at step 40"),
    ({"rank": 1, "node": "n1", "slow": "data", "step": 9, "compute_x": 1.0, "data_x": 3.0, "data_s": 0.3},
     "straggler: rank 1 on n1 is 3.0x the median in data wait (300 ms vs 100 ms per step), at step 9"),
    ({"rank": 1, "node": "n1", "slow": "data", "step": 9, "compute_x": 1.0, "data_x": None, "data_s": 0.5},
     "straggler: rank 1 on n1 spends 500 ms per step in data wait, the median rank none, at step 9"),
    ({"rank": 3, "node": "n2", "slow": "forward", "step": 5, "compute_x": 2.0},  # recorded before compute_s was
     "straggler: rank 3 on n2 is 2.0x the median in forward (? per step), at step 5"),
]


@pytest.mark.parametrize(("event", "text"), DESCRIBE)
def test_a_straggler_in_words(event: dict, text: str) -> None:
    assert stragglers.describe(event) == text


def test_a_straggler_is_alerted_once_per_rank_and_attempt(tmp_path: Path, webhook: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The host side turns the job's ledger records into alerts: twice asked (cron, then the exit hook), one alert."""
    from runner import alerts, spec
    from runner.host import notices

    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    cfg = spec.load(Path(__file__).resolve().parents[1] / "conf" / "quickstart.yaml", ["alerts.kind=json"]).data
    rd = RunDir(tmp_path / "run")
    slow = {"rank": 2, "node": "n2", "slow": "forward", "step": 40, "compute_x": 6.1, "compute_s": 0.122,
            "data_x": 1.0, "data_s": 0.001, "attempt": 1}
    rd.record("straggler", **slow)
    assert notices.queue_stragglers(rd, cfg, "17") == 1
    assert notices.queue_stragglers(rd, cfg, "17") == 0  # the second caller finds it done
    rd.record("straggler", **{**slow, "attempt": 2})  # slow again in the next attempt: news again
    assert notices.queue_stragglers(rd, cfg, "18") == 1
    assert alerts.flush_queue(rd.root, cfg["alerts"]) == (2, 0)
    first, second = webhook.wait_for(2)
    assert (first["event"], first["job_id"], first["attempt"], first["nodes"]) == ("straggler", "17", 1, "n2")
    assert first["extra"]["rank"] == "2" and first["extra"]["slower than the median"] == "6.1x in forward"
    assert first["cause"].startswith("straggler: rank 2 on n2 is 6.1x the median") and second["attempt"] == 2
    assert [e["event"] for e in rd.events()].count("straggler_alert") == 2
    assert webhook.secret not in (rd.root / "ledger.jsonl").read_text()


def test_status_ranks_shows_the_slowest_rank_and_the_last_hang(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from runner import cli

    run = tmp_path / "r1"
    for b in (_beat(0, .10, .01), _beat(1, .31, .01, "n2"), _beat(2, .10, .01)):
        (run / "heartbeats").mkdir(parents=True, exist_ok=True)
        (run / "heartbeats" / f"rank-{b['rank']:05d}.json").write_text(json.dumps({**b, "attempt": 1}))
    (run / "hang.json").write_text(json.dumps({"summary": "hang: rank 1 on n2 (not responding)", "attempt": 1,
                                               "step": 40}))
    (run / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text("name: r1\n")
    assert cli.main(["status", "r1", "--root", str(tmp_path), "--ranks"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["1", "n2"] and out[1].endswith("forward")
    assert out[-1].startswith("last hang (attempt 1, step 40): hang: rank 1 on n2")
    assert cli.main(["status", "--root", str(tmp_path), "--ranks"]) == 2
