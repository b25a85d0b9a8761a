"""Bad-node memory: nodes that failed a run are kept out of its next jobs for a while.

A node named by a failed preflight, a hang, a NODE_FAIL or repeated rank crashes is recorded in
``<run root>/nodes.jsonl``, one JSON object per line, appended (``O_APPEND``: two writers never interleave a line,
and a torn last line from a crash is skipped on reading). Forgetting is a line too (``{"clear": NODE}``), so the
file is never rewritten. An entry counts for ``resume.exclude_nodes_s`` seconds after it was recorded (the node
may have been repaired since); every submission and resubmission under the root then passes ``--exclude``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from runner.errors import RunnerError, SubmitError
from runner.host import slurm

log = logging.getLogger(__name__)

FILE = "nodes.jsonl"
# sbatch's refusals that an exclusion can cause: the nodes it leaves can never hold the job, or it names a node
# the cluster no longer has (removed or renamed since it was remembered).
REFUSALS = ("Requested node configuration is not available", "Invalid node name specified")
CAUSES = ("preflight", "hang", "node_fail", "crashes")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a hostname as Slurm's --exclude takes it


def path(root: Path) -> Path:
    return root / FILE


def record(root: Path, nodes: Iterable[str], cause: str, run: str, detail: str = "", now: float | None = None) \
        -> list[str]:
    """Remember ``nodes`` as bad (names outside ``NODE_NAME`` are dropped: they never reach sbatch)."""
    names = sorted({n.split(".")[0] for n in nodes if NODE_NAME.fullmatch(n)})
    if not names:
        return []
    when = time.time() if now is None else now
    lines = "".join(json.dumps({"node": n, "cause": cause, "run": run, "detail": detail[:300], "time": when}) + "\n"
                    for n in names)
    _append(root, lines)
    return names


def clear(root: Path, node: str, now: float | None = None) -> bool:
    """Forget ``node``; False when it was not remembered."""
    if node not in remembered(root, forget_after_s=float("inf"), now=now):
        return False
    _append(root, json.dumps({"clear": node, "time": time.time() if now is None else now}) + "\n")
    return True


def _append(root: Path, text: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(path(root), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def entries(root: Path) -> list[dict[str, Any]]:
    """Every well-formed line, oldest first; a torn or foreign line is skipped."""
    try:
        text = path(root).read_text(errors="replace")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RunnerError(f"{path(root)}: found it unreadable ({e.strerror}); expected the run root's node "
                          "memory. hint: fix its permissions or remove it") from None
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("time"), (int, float)) and (
                isinstance(item.get("node"), str) or isinstance(item.get("clear"), str)):
            out.append(item)
    return out


def remembered(root: Path, forget_after_s: float, now: float | None = None) -> dict[str, dict[str, Any]]:
    """node -> its newest entry, for nodes recorded within ``forget_after_s`` and not cleared since."""
    when = time.time() if now is None else now
    bad: dict[str, dict[str, Any]] = {}
    for item in entries(root):
        if "clear" in item:
            bad.pop(item["clear"], None)
        elif when - item["time"] <= forget_after_s:
            bad[item["node"]] = item
        else:
            bad.pop(item["node"], None)
    return bad


def exclude(nodes: Iterable[str]) -> list[str]:
    """``["--exclude=n1,n3"]`` for sbatch, or ``[]``."""
    names = sorted(nodes)
    return [f"--exclude={','.join(names)}"] if names else []


def let_in_first(bad: Sequence[str], have: Collection[str] | None, needed: int) -> int:
    """How many of the oldest remembered bad nodes (``bad``, oldest first) to let back in before the first sbatch,
    so that the partition's other nodes (``have``; None: Slurm could not say) can hold ``needed`` nodes: a job Slurm
    could never place is never submitted (sbatch may accept one and fail it at once)."""
    if not have:
        return 0
    for n in range(len(bad) + 1):
        if len(set(have) - set(bad[n:])) >= needed:
            return n
    return len(bad)


def submit(script: str, root: Path, forget_after_s: float, after: str | None = None, needed: int = 0,
           partition: str | None = None) -> tuple[str, list[str]]:
    """sbatch ``script`` without the nodes ``root`` remembers as bad; returns the job id and the remembered nodes
    that had to be let back in.

    When the job's partition (Slurm's default one for None) has too few other nodes for ``needed``, the oldest
    exclusions are let back in before sbatch (``let_in_first``). When Slurm still refuses because the nodes left can
    never hold the job or because it no longer knows a remembered node, more are let back in, one by one: a job that
    may land on a suspect node beats a run that can never start again. Any other refusal, or one that remains
    without exclusions, is raised as it is.
    """
    bad = [n for n, _ in sorted(remembered(root, forget_after_s).items(), key=lambda kv: (kv[1]["time"], kv[0]))]
    let_in = let_in_first(bad, slurm.partition_nodes(partition), needed) if bad and needed else 0
    while True:
        keep = bad[let_in:]
        try:
            job = slurm.submit(script, extra=exclude(keep), after=after)
        except SubmitError as e:
            if not keep or not any(r in str(e) for r in REFUSALS):
                raise
            let_in += 1
            continue
        if let_in:
            log.warning("the job's partition cannot hold it without %s: %s let back in (the oldest exclusions)",
                        ",".join(sorted(bad)), ",".join(bad[:let_in]))
        return job, bad[:let_in]


def table(bad: dict[str, dict[str, Any]], now: float | None = None) -> str:
    if not bad:
        return "no nodes remembered as bad"
    when = time.time() if now is None else now
    rows = [("NODE", "CAUSE", "AGE", "RUN", "DETAIL")]
    rows += [(n, e.get("cause", "?"), f"{(when - e['time']) / 60:.0f}m", str(e.get("run", "")),
              str(e.get("detail", ""))[:60]) for n, e in sorted(bad.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows)


def named_by(outcome: str, report: Any, attempt: int | None = None) -> list[str]:
    """The nodes an attempt's own report blames: a hang's suspects (``hang.json`` of that attempt; none when every
    rank is one) or the nodes whose preflight checks failed (``preflight.json``; none when every node failed).
    When all are blamed, the cause is the job (its config, its code, the network as a whole), and excluding
    them all would only leave it pending."""
    if not isinstance(report, dict):
        return []
    if outcome == "hang" and (attempt is None or report.get("attempt") == attempt):
        if len(report.get("suspects") or []) >= int(report.get("world") or 0):
            return []  # every rank is a suspect: nothing tells a node apart
        named, hosts = report.get("nodes") or [], list[Any]()
    elif outcome == "preflight_failed":
        named = [c.get("node") for c in report.get("checks") or [] if isinstance(c, dict) and c.get("status") == "fail"]
        hosts = report.get("nodes") or []
    else:
        return []
    named = sorted({str(n).split(".")[0] for n in named if isinstance(n, str) and NODE_NAME.fullmatch(n)})
    everyone = {str(n).split(".")[0] for n in hosts}
    return [] if not named or (everyone and everyone <= set(named)) else named
