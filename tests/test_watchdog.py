"""The hang watchdog: the analysis as tables (the thread with real processes that really stop advancing:
tests/test_watchdog_local.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runner import spec, stragglers
from runner.errors import ConfigError
from runner.job.watchdog import (
    BEFORE_VALIDATION,
    CHECKPOINT,
    CHECKPOINT_WRITE,
    EPOCH_END,
    EPOCH_START,
    FIRST_STEP,
    VALIDATION,
    Watchdog,
    allowance,
    phase,
    quantile,
    summarize,
)
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
    assert rd.rank_hosts(2) == {0: "n1", 1: "n3"}
    s = summarize({0: {"phase": "collective"}}, 3, rd.rank_hosts(2))
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


# --- the limit: what is normal for this run ---------------------------------------------------------------------

DEFAULTS = {"factor": 10, "floor_s": 5, "phase_s": 900, "first_step_s": 900}  # runner.spec.schema's watchdog
STEADY = [0.1] * 1000
JITTERY = [0.1 * (1 + i % 8) for i in range(1000)]  # 0.1 to 0.8 s
SPIKY = [1.5 if i % 50 == 0 else 0.1 for i in range(1000)]  # a 1.5 s step (a log flush) every 50: 2%
LIMITS = [
    # (phase, step times, longest pause per phase, limit)
    pytest.param(None, STEADY, {}, 5, id="0.1 s steps: the floor (a hang named within 15 s)"),
    pytest.param(None, JITTERY, {}, 8.0, id="jittery steps: 10x their 99th percentile"),
    pytest.param(None, SPIKY, {}, 15.0, id="a slow step every 50: 10x it, not 10x the median"),
    pytest.param(None, [0.1] * 995 + [40.0] * 5, {}, 5, id="a few outliers in 1,000 do not raise it"),
    pytest.param(None, [], {}, 5, id="the second step: no step time yet"),
    pytest.param(FIRST_STEP, [], {}, 900, id="the first step: first_step_s"),
    pytest.param(VALIDATION, STEADY, {}, 900, id="a first validation: phase_s"),
    pytest.param(VALIDATION, STEADY, {VALIDATION: 20.0, CHECKPOINT: 10.0}, 200, id="validation: 10x its longest"),
    pytest.param(CHECKPOINT, STEADY, {VALIDATION: 20.0, CHECKPOINT: 10.0}, 100, id="checkpoint: 10x its longest"),
    pytest.param(EPOCH_END, STEADY, {VALIDATION: 20.0}, 900, id="phases are learned apart"),
    pytest.param(CHECKPOINT, STEADY, {CHECKPOINT: 0.02}, 5, id="a fast phase: the floor"),
    pytest.param(VALIDATION, STEADY, {VALIDATION: 300.0}, 900, id="never above phase_s"),
    pytest.param(CHECKPOINT_WRITE, STEADY, {CHECKPOINT_WRITE: 12.0}, 120,
                 id="a save waiting for the previous write: 10x the longest write"),
    pytest.param(BEFORE_VALIDATION, STEADY, {BEFORE_VALIDATION: 0.01}, 900,
                 id="before a validation that may not come: never learned"),
]


@pytest.mark.parametrize(("ph", "steps", "longest", "expected"), LIMITS)
def test_the_limit_from_the_step_times_and_the_phases_seen(ph: str | None, steps: list[float],
                                                           longest: dict[str, float], expected: float) -> None:
    assert allowance(ph, steps, longest, **DEFAULTS) == pytest.approx(expected)


def test_without_a_first_step_limit_the_first_step_waits_forever() -> None:
    assert allowance(FIRST_STEP, [], {}, **{**DEFAULTS, "first_step_s": None}) == float("inf")


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([3.0, 1.0, 2.0], 0.5, 2.0), ([1.0] * 99 + [9.0], 0.99, 1.0), ([1.0] * 98 + [9.0] * 2, 0.99, 9.0),
    ([4.0], 0.99, 4.0)])
def test_quantile_is_the_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert quantile(values, q) == expected


# --- the training thread's marks, replayed with their times: when is a hang named ---------------------------------

def steps(t0: float, n: int, dt: float = 0.1, first: int = 0) -> list[tuple[float, str, object]]:
    """n training steps of dt seconds from t0, numbered from ``first``: each batch starts, then its step ends."""
    return timed(t0, [dt] * n, first)


def timed(t0: float, durations: list[float], first: int = 0) -> list[tuple[float, str, object]]:
    """Training steps one after the other from t0, taking ``durations`` seconds."""
    out: list[tuple[float, str, object]] = []
    for i, d in enumerate(durations):
        out += [(t0, "batch", None), (t0 + d, "step", first + i)]
        t0 += d
    return out


def validation(t0: float, batches: list[float]) -> list[tuple[float, str, object]]:
    """After the batch at t0: Lightning's validation, its batches taking ``batches`` seconds each, then its end."""
    out: list[tuple[float, str, object]] = [(t0, "enter", BEFORE_VALIDATION), (t0 + 0.3, "enter", VALIDATION)]
    t = t0 + 0.3
    for b in batches:
        t += b
        out.append((t, "enter", VALIDATION))
    return [*out, (t + 0.1, "leave", None)]


def save(t0: float, waited: float) -> list[tuple[float, str, object]]:
    """runner's save after the step at t0: it waits ``waited`` seconds for the previous write, snapshots in 0.1 s."""
    return [(t0, "enter", CHECKPOINT_WRITE), (t0 + waited, "enter", CHECKPOINT), (t0 + waited + 0.1, "batch", None)]


def first_hang(tmp_path: Path, events: list[tuple[float, str, object]], until_s: float) -> float | None:
    """Replays ``events`` (seconds after the watchdog's start) into a real Watchdog (its thread not started) and
    asks it every 0.1 s, as its thread does, whether this is a hang: the first time it is, or None until
    ``until_s``."""
    wd = Watchdog(RunDir(tmp_path), 0, 1, 1, factor=10, floor_s=5, first_step_s=900, phase_s=900)
    t0 = time.monotonic()  # the first step's clock started at the construction, microseconds before
    calls = {"batch": lambda t, _: wd.batch_start(t), "step": lambda t, step: wd.beat(step, t),
             "enter": lambda t, ph: wd.enter(ph, t), "leave": lambda t, _: wd.leave(t),
             "wrote": lambda t, s: wd.learn(CHECKPOINT_WRITE, s)}  # a background write ended, after s seconds
    pending = sorted(events, key=lambda e: e[0])
    for tick in range(int(until_s * 10) + 1):
        now = tick / 10
        while pending and pending[0][0] <= now:
            t, kind, arg = pending.pop(0)
            calls[kind](t0 + t, arg)
        if wd.overdue(t0 + now):
            return now
    return None


RUN = steps(0.0, 1, 30.0) + steps(30.0, 200, first=1)  # a 30 s first step (start-up, compiling), then 0.1 s steps
END = RUN[-1][0]  # the last of RUN's steps: 50 s
JITTER = [0.5, 0.5, 2.0] * 100  # seconds per step
TIMELINES = [
    # (events, checked until, the first moment a hang is named: None for no hang)
    pytest.param(RUN, END + 60, END + 5.1, id="0.1 s steps stop: named 5 s after the last one"),
    pytest.param([*RUN, *validation(END, [20.0]), *steps(END + 20.5, 100, first=201),
                  (END + 30.5, "enter", CHECKPOINT), *steps(END + 40.5, 100, first=301)], END + 55.0, None,
                 id="a 20 s validation and a 10 s checkpoint: no hang"),
    pytest.param([*RUN, *validation(END, [20.0]), *steps(END + 20.5, 100, first=201),
                  *validation(END + 30.5, [35.0]), *steps(END + 66.0, 10, first=301)], END + 71.0, None,
                 id="a second validation longer than the first, within 10x: no hang"),
    pytest.param([*RUN, *validation(END, [20.0]), *steps(END + 20.5, 100, first=201),
                  *validation(END + 30.5, [250.0])], END + 400, END + 30.8 + 200, id="... and past 10x the first"),
    pytest.param([*RUN, *validation(END, [20.0])], END + 60, END + 20.4 + 5.1,
                 id="a step stalled right after a validation ends: the step limit again"),
    pytest.param([*RUN, (END, "enter", CHECKPOINT), (END + 10, "batch", None)], END + 60, END + 10 + 5.1,
                 id="a step stalled after a checkpoint: its phase ends when the next batch starts"),
    pytest.param([*RUN, (END, "enter", EPOCH_END), (END + 12, "enter", EPOCH_START),
                  *steps(END + 40, 10, first=201)], END + 45.0, None,
                 id="an epoch's end and the next loader's start, first seen: phase_s"),
    pytest.param([*RUN, *save(END, 0.0), *(s1 := steps(END + 0.1, 100, first=201)), (END + 18.1, "wrote", 18.0),
                  *save(s1[-1][0], 8.0), *(s2 := steps(s1[-1][0] + 8.1, 100, first=301)),
                  (s1[-1][0] + 8.1 + 18, "wrote", 18.0), *save(s2[-1][0], 8.0),
                  *steps(s2[-1][0] + 8.1, 10, first=401)], s2[-1][0] + 9.2, None,
                 id="saves waiting 8 s for writes of 18 s: the first wait phase_s, then 10x the writes"),
    pytest.param([*RUN, *save(END, 0.0), *(s3 := steps(END + 0.1, 100, first=201)), (END + 5.1, "wrote", 0.05),
                  *save(s3[-1][0], 0.0)], END + 30, s3[-1][0] + 0.1 + 5.1,
                 id="a fast write: a save stalled after it is held to the step limit"),
    pytest.param([(10.0, "enter", VALIDATION), (60.0, "leave", None)], 1000, 900.1,
                 id="no first step: first_step_s, whatever is marked before it"),
    pytest.param(steps(0.0, 1, 800.0) + steps(800.0, 10, first=1), 820, 801.0 + 5.1,
                 id="a first step in 800 s: no hang"),
    pytest.param(timed(0.0, JITTER), 300 + 30, 300 + 20.1,
                 id="jittery steps (0.5 s, 2 s every third): 10x the slow ones, no false alarm"),
]


@pytest.mark.parametrize(("events", "until_s", "named_at"), TIMELINES)
def test_when_a_hang_is_named(tmp_path: Path, events: list[tuple[float, str, object]], until_s: float,
                              named_at: float | None) -> None:
    got = first_hang(tmp_path, events, until_s)
    assert got == (None if named_at is None else pytest.approx(named_at, abs=0.11))


def test_the_peers_of_a_stopped_rank_waiting_in_a_collective_are_named_by_the_step_limit(tmp_path: Path) -> None:
    """A stopped rank's peer blocks in the next step's collective after its batch started: no phase is marked there
    (only the markers make a pause legitimate, never what the stack shows), so the step limit names it, even right
    after a checkpoint."""
    events = [*RUN, (END, "enter", CHECKPOINT), (END + 0.2, "batch", None)]
    assert first_hang(tmp_path, events, END + 30) == pytest.approx(END + 0.2 + 5.1, abs=0.11)


@pytest.mark.parametrize(("override", "key"), [("watchdog.phase_s=0", "watchdog.phase_s"),
                                               ("watchdog.plain_floor_s=-1", "watchdog.plain_floor_s"),
                                               ("watchdog.floor_s=0.5", "watchdog.floor_s"),
                                               ("watchdog.phase_s=soon", "watchdog.phase_s")])
def test_the_watchdog_settings_are_checked_in_one_line(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec.load(Path(__file__).resolve().parents[1] / "conf" / "quickstart.yaml", [override])
    [line] = [p for p in err.value.problems if f": {key}: " in p]
    assert "\n" not in line


def test_the_watchdog_defaults() -> None:
    w = spec.load(Path(__file__).resolve().parents[1] / "conf" / "quickstart.yaml", []).data["watchdog"]
    assert (w["floor_s"], w["factor"], w["phase_s"], w["first_step_s"], w["plain_floor_s"]) == (5, 10, 900, 900, 30)


@pytest.mark.parametrize(("silent_s", "waits"), [(130.0, False), (50.0, True)],
                         ids=["silent two beats when asked: named at once", "silent one beat: one beat more"])
def test_a_rank_silent_for_two_beats_is_named_without_waiting_a_beat_more(tmp_path: Path, silent_s: float,
                                                                          waits: bool) -> None:
    """The rank that fires asks the others for their reports; one that had stopped beating two heartbeats before
    (a SIGSTOPped rank named after the floor's seconds) will not answer, and the summary is written at once. One
    silent for less may be a late heartbeat thread: it gets a beat more. (A 60 s heartbeat interval: a wait shows.)"""
    rd = RunDir(tmp_path)
    rd.heartbeats.mkdir()
    (rd.heartbeats / "rank-00001.json").write_text(json.dumps({"rank": 1, "attempt": 1, "host": "n2",
                                                               "time": time.time() - silent_s}))
    dog = Watchdog(rd, 0, 2, 1, factor=10, floor_s=5, interval_s=60.0)
    rd.hang_reports(1).mkdir(parents=True)
    (rd.hang_reports(1) / "rank-00000.json").write_text(json.dumps({"rank": 0, "host": "n1", "phase": "collective",
                                                                    "step": 7}))
    done = threading.Thread(target=dog._conclude, daemon=True)
    done.start()
    done.join(timeout=2)
    assert done.is_alive() is waits
    if waits:  # rank 1 answers: the summary follows
        (rd.hang_reports(1) / "rank-00001.json").write_text(json.dumps({"rank": 1, "host": "n2", "phase": "data",
                                                                        "step": 7}))
        done.join(timeout=20)
    hang = json.loads(rd.hang.read_text())
    assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(1, "n2")], hang
