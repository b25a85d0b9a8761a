"""What an alert says: the Alert record, its Slack Block Kit and generic JSON bodies, and redaction.

Pure functions of an Alert, used on the login node (cron, resubmission), by the batch script's exit hook
and by a local run. Every body is rendered through ``redact`` so that no webhook URL (a Slack URL is a write
token) and no text that looks like one leaves in a message, a queue file or a log line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from runner.alerts.nextstep import NEXT_STEPS as NEXT_STEPS
from runner.alerts.nextstep import cause_step, next_step
from runner.ledger import CAUSE_KINDS, AlertEvent, CauseKind
from runner.redaction import redact as redact
from runner.redaction import redact_obj as redact_obj
from runner.spec.schema import EVENTS

SLACK_SECTION_LIMIT = 3000
SLACK_FIELD_LIMIT = 2000
SLACK_HEADER_LIMIT = 150

_TITLES: dict[AlertEvent, str] = {
    "failed": "failed",
    "preempted": "preempted",
    "requeued": "requeued",
    "timeout": "hit its time limit",
    "resubmitted": "resubmitted",
    "gave_up": "gave up",
    "completed": "completed",
    "cancelled": "cancelled",
    "preflight_failed": "failed preflight",
    "hang": "hung",
    "nan": "stopped on a NaN",
    "straggler": "has a straggler",
}

_EMOJI: dict[AlertEvent, str] = {
    "failed": ":x:",
    "preempted": ":hourglass:",
    "requeued": ":repeat:",
    "timeout": ":alarm_clock:",
    "resubmitted": ":arrows_counterclockwise:",
    "gave_up": ":no_entry:",
    "completed": ":white_check_mark:",
    "cancelled": ":heavy_multiplication_x:",
    "preflight_failed": ":warning:",
    "hang": ":hourglass_flowing_sand:",
    "nan": ":warning:",
    "straggler": ":snail:",
}

# A cause's title and emoji (its next step: ``nextstep.CAUSE_STEPS``).
CAUSE_TITLES: dict[CauseKind, str] = {
    "oom": "out of memory",
    "node_failure": "a node failed",
    "time_limit": "the time limit",
    "preemption": "a preemption",
    "nccl_timeout": "a collective timed out",
    "program": "the program cannot train",
    "exception": "a Python exception",
    "crash_loop": "the same crash twice",
    "bad_nodes": "a node failed the preflight",
    "nan": "a non-finite loss or gradient",
    "hang": "training hung",
    "rank": "a rank failed first",
    "hook": "a hook of the batch script failed",
    "unknown": "no known cause",
}

CAUSE_EMOJI: dict[CauseKind, str] = {
    "oom": ":boom:",
    "node_failure": ":skull:",
    "time_limit": ":alarm_clock:",
    "preemption": ":hourglass:",
    "nccl_timeout": ":electric_plug:",
    "program": ":page_facing_up:",
    "exception": ":snake:",
    "crash_loop": ":repeat_one:",
    "bad_nodes": ":warning:",
    "nan": ":warning:",
    "hang": ":hourglass_flowing_sand:",
    "rank": ":dart:",
    "hook": ":wrench:",
    "unknown": ":grey_question:",
}


@dataclasses.dataclass
class Alert:
    """One event of one run, everything a person needs to decide what to do."""

    event: AlertEvent
    run: str
    run_dir: str = ""
    job_id: str = ""
    attempt: int = 1
    nodes: str = ""
    exit_code: int | None = None
    slurm_state: str | None = None
    cause: str | None = None  # the sentence (``runner.alerts.causes.Cause``'s, or a caller's own words)
    cause_kind: CauseKind | None = None  # the Cause's kind, when one was found
    log_tail: list[str] = dataclasses.field(default_factory=list)
    next_step: str = ""
    extra: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown alert event {self.event!r}; expected one of {', '.join(EVENTS)}")
        if self.cause_kind is not None and self.cause_kind not in CAUSE_KINDS:
            raise ValueError(f"unknown cause kind {self.cause_kind!r}; expected one of {', '.join(CAUSE_KINDS)}")
        # Callers pass Paths, ints and Nones from sacct/env; the payload wants plain JSON values.
        self.run_dir = os.fspath(self.run_dir)
        self.job_id = "" if self.job_id is None else str(self.job_id)
        self.attempt = int(self.attempt)
        self.nodes = "" if self.nodes is None else str(self.nodes)
        self.exit_code = None if self.exit_code is None else int(self.exit_code)
        self.log_tail = [str(line) for line in self.log_tail]
        self.extra = {str(k): str(v) for k, v in self.extra.items()}


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ------------------------------------------------------------------------------------ redaction


def redacted_alert(alert: Alert, secrets: Iterable[str]) -> Alert:
    return Alert(**redact_obj(dataclasses.asdict(alert), list(secrets)))


# ------------------------------------------------------------------------------------- payloads


def _summary(a: Alert) -> str:
    job = f"job {a.job_id}, " if a.job_id else ""
    cause = f": {a.cause}" if a.cause else ""
    return f"{a.run} {_TITLES[a.event]} ({job}attempt {a.attempt}){cause}"


def _mrkdwn(text: str) -> str:
    """Slack's three control characters; without this a log line with <!channel> pings everyone."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _field(label: str, value: object) -> dict[str, str]:
    shown = "—" if value is None or value == "" else str(value)
    head = f"*{label}*\n"
    return {"type": "mrkdwn", "text": head + clip(_mrkdwn(shown), SLACK_FIELD_LIMIT - len(head))}


def _cause_field(a: Alert) -> dict[str, str]:
    """The cause, with its emoji and what to do about it when its kind is known."""
    if a.cause_kind is None or not a.cause:
        return _field("Cause", a.cause)
    return _field("Cause", f"{CAUSE_EMOJI[a.cause_kind]} {a.cause}\n{cause_step(a.cause_kind)}")


def _code_section(lines: list[str]) -> dict[str, Any]:
    """The newest log lines that fit in one section; older ones are cut first."""
    fence_open, fence_close = "```\n", "\n```"
    label_room = 60  # "*Last NN log lines* (NNNN earlier lines cut)\n"
    budget = SLACK_SECTION_LIMIT - len(fence_open) - len(fence_close) - label_room
    escaped = [_mrkdwn(line.replace("```", "'''")) for line in lines]
    kept: list[str] = []
    used = 0
    for line in reversed(escaped):
        cost = len(line) + (1 if kept else 0)
        if used + cost > budget:
            break
        kept.append(line)
        used += cost
    if not kept and escaped:
        kept = ["…" + escaped[-1][-(budget - 1) :]]
    kept.reverse()
    cut = len(lines) - len(kept)
    label = f"*Last {len(kept)} log line{'' if len(kept) == 1 else 's'}*" + (f" ({cut} earlier cut)" if cut else "")
    text = f"{label}\n{fence_open}{chr(10).join(kept)}{fence_close}"
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def slack_payload(alert: Alert, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """Block Kit message: header, fields, last log lines, what happens next; `text` for notifications."""
    a = redacted_alert(alert, secrets)
    state = f"{'—' if a.exit_code is None else a.exit_code} / {a.slurm_state or '—'}"
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": clip(f"{_EMOJI[a.event]} {a.run} {_TITLES[a.event]}", SLACK_HEADER_LIMIT),
                "emoji": True,
            },
        },
        {
            "type": "section",
            "fields": [
                _field("Run", a.run),
                _field("Job ID", a.job_id),
                _field("Attempt", a.attempt),
                _field("Nodes", a.nodes),
                _field("Event", a.event),
                _field("Exit code / Slurm state", state),
                _cause_field(a),
            ],
        },
    ]
    if a.extra:
        lines = "\n".join(f"*{_mrkdwn(k)}*: {_mrkdwn(v)}" for k, v in a.extra.items())
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": clip(lines, SLACK_SECTION_LIMIT)}})
    if a.log_tail:
        blocks.append(_code_section(a.log_tail))
    context = f"*Next:* {_mrkdwn(a.next_step or next_step(a.event))}"
    if a.run_dir:
        context += f"  ·  run dir `{_mrkdwn(a.run_dir)}`"
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(context, SLACK_FIELD_LIMIT)}]})
    return {"text": clip(_mrkdwn(_summary(a)), SLACK_SECTION_LIMIT), "blocks": blocks}


def json_payload(alert: Alert, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """Every Alert field as plain JSON, plus `source`, `title` and a one-line `text`; with a cause of a known kind,
    its `cause_title` and `cause_step` (what to do about it)."""
    a = redacted_alert(alert, secrets)
    body: dict[str, Any] = {"source": "runner", "title": f"{a.run} {_TITLES[a.event]}", "text": _summary(a)}
    body.update(dataclasses.asdict(a))
    if not body["next_step"]:
        body["next_step"] = next_step(a.event)
    if a.cause_kind is not None:
        body.update(cause_title=CAUSE_TITLES[a.cause_kind], cause_step=cause_step(a.cause_kind))
    return body


def render_payload(alert: Alert, kind: str, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The body for a webhook of `kind` (``alerts.kind``: "slack" or "json")."""
    renderers = {"slack": slack_payload, "json": json_payload}
    if kind not in renderers:
        raise ValueError(f"unknown alerts kind {kind!r}; expected one of {', '.join(renderers)}")
    return renderers[kind](alert, secrets=secrets)


def fallback_payload(alert: Alert, kind: str, error: BaseException, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The body sent when the full one cannot be built (a bug in a renderer): plain text from the Alert's own
    fields, no table looked up, and the error named, so that an alert never vanishes for its looks."""
    a = redacted_alert(alert, secrets)
    job = f"job {a.job_id}, " if a.job_id else ""
    text = redact(f"{a.run} {a.event} ({job}attempt {a.attempt})" + (f": {a.cause}" if a.cause else "")
                  + (f". Next: {a.next_step}" if a.next_step else "")
                  + f" [runner could not build the full alert: {type(error).__name__}: {error}]", list(secrets))
    if kind == "slack":
        return {"text": clip(_mrkdwn(text), SLACK_SECTION_LIMIT)}
    body: dict[str, Any] = {"source": "runner", "title": f"{a.run} {a.event}", "text": text}
    body.update(dataclasses.asdict(a))
    return body
