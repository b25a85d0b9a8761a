"""Which keys of a config are runner's and which are its program's.

In program mode (``command:``) one file configures runner and the program it runs (ESPnet3 reads the same YAML).
runner owns the schema's keys; ``SHARED`` ones (``num_nodes``, ``trainer``, ...) are read by both; every other
top-level key is the program's and is passed through untouched. runner's own settings may sit in one ``runner:``
block: then runner reads them there only, and top-level keys such as ESPnet3's ``scheduler:`` (its learning-rate
scheduler) and ``seed:`` are the program's. The validated dict has one shape either way: runner's settings at the
top level, the program's keys under ``program``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from runner.spec.schema import BLOCK, PROGRAM, RUNNER_ONLY, SCHEMA, SHARED, TOP_LEVEL
from runner.spec.validate import Problems

MODEL = ("model", "data")  # runner's own mode's; beside a command they are the program's (under a runner: block)


@dataclass
class Split:
    own: dict[str, Any]  # runner's keys, in the validated dict's shape (a runner: block's settings at the top level)
    program: dict[str, Any] = field(default_factory=dict)  # the top-level keys runner does not own, as written
    block: bool = False  # runner's settings came from a runner: block


def split(data: dict[str, Any], problems: Problems) -> Split:
    """Sort a config's top-level keys into runner's and the program's. A key of the program's that is a near miss
    of one runner owns (``trainner``) is a problem, as is any key under ``runner:`` that is not a runner setting."""
    has_block, block = BLOCK in data, data.get(BLOCK)
    block = {} if block is None else block  # an empty runner: block
    program_mode = data.get("command") is not None
    if has_block:
        if not isinstance(block, dict):
            problems.add(BLOCK, block, "a mapping of runner's own settings", f"e.g. runner: {{scheduler: slurm}}; "
                         f"known: {', '.join(RUNNER_ONLY)}")
            block = {}
        owned: tuple[str, ...] = (*SHARED, *TOP_LEVEL, BLOCK)
        own = {k: v for k, v in data.items() if k in owned and k != BLOCK}
        for k, v in block.items():
            if k in RUNNER_ONLY:
                own[k] = v
            elif k in SHARED or k in TOP_LEVEL:
                problems.add(f"{BLOCK}.{k}", k, "one of runner's own settings", f"put {k} at the top level (it is "
                             + ("shared with your program)" if k in SHARED else "what runs)"))
            else:
                close = difflib.get_close_matches(str(k), RUNNER_ONLY, n=1)
                problems.add(f"{BLOCK}.{k}", k, "one of runner's own settings",
                             f"did you mean {BLOCK}.{close[0]}?" if close else f"known: {', '.join(RUNNER_ONLY)}")
        problems.moved = RUNNER_ONLY
    else:
        owned = (*SCHEMA, BLOCK)
        own = {k: v for k, v in data.items() if k in owned}
    stored = data.get(PROGRAM)  # a resolved config (config.yaml) read back: the program's keys, already apart
    out = Split(own, dict(stored) if isinstance(stored, dict) else {}, has_block)
    candidates = [k for k in owned if not (program_mode and k in MODEL)]
    for k, v in data.items():
        if k in owned or (k == PROGRAM and isinstance(v, dict)):
            continue
        typo = near_miss(str(k), candidates)
        if typo:
            problems.add(str(k), k, f"{typo} or a key of your program's (not this close to {typo})",
                         f"did you mean {typo}?")
            continue
        # slurm: left beside a runner: block (a program's model: beside one is as meant)
        if has_block and k in RUNNER_ONLY and isinstance(SCHEMA[k], dict) and not (program_mode and k in MODEL):
            problems.note(f"{k}: at the top level it is your program's (this config has a {BLOCK}: block); "
                          f"runner reads {BLOCK}.{k}")
        out.program[k] = v
    return out


def near_miss(key: str, owned: Iterable[str]) -> str | None:
    """The key runner owns that ``key`` is a typo of, or None: at most 2 edits (a swap of neighbours is one), 1
    for a key of 4 letters or fewer (two edits make another word there: ``beta`` is not ``data``)."""
    for name in owned:
        limit = 1 if len(name) <= 4 else 2
        if key != name and abs(len(key) - len(name)) <= limit and distance(key, name) <= limit:
            return name
    return None


def distance(a: str, b: str) -> int:
    """Edit distance (insert, delete, replace, swap two neighbours: one each)."""
    before: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, before[j - 2] + 1)
            cur.append(cost)
        before, prev = prev, cur
    return prev[-1]
