"""Which ranks are slow: per-rank step timings against the median, from the ranks' heartbeats.

Under DDP every rank's *step* takes as long as the slowest one (the gradient all-reduce waits for it), so the
step time cannot name a straggler. What differs is the time a rank spends on its own before the collective: its
forward (batch start to backward) and its wait for data (previous batch end to this batch start). Each rank's
watchdog thread writes the medians of those over its last steps into its heartbeat; this module compares them.
It is pure and used on both sides: rank 0 in the job (``stragglers.json``, ledger event ``straggler``),
``runner status RUN --ranks`` and the straggler alert (``describe``) on the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

SLOW = 1.5  # a rank this many times slower than the median (forward or data wait) is a straggler
MIN_GAP_S = 0.005  # below this, differences are noise (the tiny example's 1 ms steps)


def compare(beats: Sequence[Mapping[str, Any]], slow: float = SLOW) -> list[dict[str, Any]]:
    """One row per rank with timings: its forward and data-wait medians, their ratio to the median over all
    ranks, and ``slow`` when either ratio exceeds ``slow`` (and the gap is above noise). Slowest first."""
    timed = [b for b in beats if isinstance(b.get("compute_s"), (int, float)) and
             isinstance(b.get("data_s"), (int, float))]
    if not timed:
        return []
    med_c = statistics.median(float(b["compute_s"]) for b in timed)
    med_d = statistics.median(float(b["data_s"]) for b in timed)
    rows = []
    for b in timed:
        c, d = float(b["compute_s"]), float(b["data_s"])
        rc = c / med_c if med_c > 0 else 1.0
        rd = d / med_d if med_d > 0 else (1.0 if d < MIN_GAP_S else float("inf"))
        slow_c = rc > slow and c - med_c > MIN_GAP_S
        slow_d = rd > slow and d - med_d > MIN_GAP_S
        rows.append({"rank": int(b.get("rank", -1)), "node": str(b.get("host", "?")), "step": b.get("step"),
                     "compute_s": round(c, 4), "data_s": round(d, 4), "compute_x": round(rc, 2),
                     "data_x": round(rd, 2) if rd != float("inf") else None,
                     "slow": "forward" if slow_c else "data" if slow_d else None})
    return sorted(rows, key=lambda r: (r["slow"] is None, -max(r["compute_x"], r["data_x"] or 0.0), r["rank"]))


def table(rows: Sequence[Mapping[str, Any]], top: int = 8) -> str:
    if not rows:
        return "no rank timings yet (the ranks write them every few seconds once training runs)"
    lines = [f"{'RANK':>5}  {'NODE':<16} {'FORWARD':>9} {'x MED':>6} {'DATA':>9} {'x MED':>6}  SLOW"]
    for r in rows[:top]:
        data_x = f"{r['data_x']:.2f}" if r["data_x"] is not None else "-"
        lines.append(f"{r['rank']:>5}  {r['node']:<16} {r['compute_s'] * 1000:>7.1f}ms {r['compute_x']:>6.2f} "
                     f"{r['data_s'] * 1000:>7.1f}ms {data_x:>6}  {r['slow'] or ''}")
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more ranks, none slower")
    return "\n".join(lines)


def describe(event: Mapping[str, Any]) -> str:
    """A ledger ``straggler`` record in words: the rank, its node, and how much slower than the median it is."""
    forward = event.get("slow") != "data"
    x, mine = (event.get("compute_x"), event.get("compute_s")) if forward else (event.get("data_x"),
                                                                                 event.get("data_s"))
    what = "forward" if forward else "data wait"
    head = f"straggler: rank {event.get('rank')} on {event.get('node')}"
    if not isinstance(x, (int, float)):  # the other ranks wait ~0 for data: a ratio means nothing
        return f"{head} spends {_ms(mine)} per step in {what}, the median rank none, at step {event.get('step')}"
    median = f" vs {_ms(mine / x)}" if isinstance(mine, (int, float)) and x > 0 else ""
    return f"{head} is {x:.1f}x the median in {what} ({_ms(mine)}{median} per step), at step {event.get('step')}"


def _ms(seconds: Any) -> str:
    return f"{seconds * 1000:.0f} ms" if isinstance(seconds, (int, float)) else "?"
