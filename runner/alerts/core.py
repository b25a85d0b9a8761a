"""Webhook alerts for run events (Slack Block Kit or generic JSON).

A failing alert must never fail the job: `send` and `flush_queue` catch everything, print at most one
line to stderr and keep undelivered alerts in `RUN_DIR/alerts/queue/` for a later `flush_queue`
(called by `runner cron`, and by `send` itself before a new alert so the order is kept).

The webhook URL is a secret (a Slack URL is a write token). It is read only at the moment of
sending and never lands in an exception, a log line, printed output or a queue file; log tails and
other free text are scrubbed of it, and of anything that looks like a Slack webhook, before
rendering.

Stdlib only at import time; `requests` is imported when something is sent (urllib otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import errno
import json
import os
import re
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runner.errors import RunnerError
from runner.spec.schema import EVENTS

KINDS: tuple[str, ...] = ("slack", "json")

DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "kind": "slack",
    "url_env": "RUNNER_WEBHOOK_URL",
    "url_file": None,
    "events": list(EVENTS),
    "timeout_s": 5.0,
    "retries": 3,
    "backoff_s": 1.0,
}

# Bounds that are not worth a config key: a server may ask for long pauses, but the caller (often a
# trap with a few seconds before SIGKILL) must get control back; what is not sent is queued.
RETRY_AFTER_CAP_S = 60.0
MAX_TOTAL_S = 60.0

TAIL_LINES = 30
# Lines of a rank log searched for a cause: enough for a long traceback, few enough not to blame
# the previous attempt when logs are appended across requeues.
CAUSE_LINES = 200
SLACK_SECTION_LIMIT = 3000
SLACK_FIELD_LIMIT = 2000
SLACK_HEADER_LIMIT = 150

NEXT_STEPS: dict[str, str] = {
    "failed": "Not retried automatically: fix the cause, then resubmit.",
    "preempted": "The job is requeued and resumes from the last checkpoint.",
    "requeued": "Waiting in the queue; it resumes from the last checkpoint when it starts.",
    "timeout": "Resumes from the last checkpoint if attempts remain.",
    "resubmitted": "A new job was submitted; it resumes from the last checkpoint.",
    "gave_up": "No attempts left: needs a person.",
    "completed": "Nothing: training finished.",
    "cancelled": "Nothing: the job was cancelled.",
    "preflight_failed": "Training did not start: fix the failed check, then resubmit.",
}

_TITLES = {
    "failed": "failed",
    "preempted": "preempted",
    "requeued": "requeued",
    "timeout": "hit its time limit",
    "resubmitted": "resubmitted",
    "gave_up": "gave up",
    "completed": "completed",
    "cancelled": "cancelled",
    "preflight_failed": "failed preflight",
}

_EMOJI = {
    "failed": ":x:",
    "preempted": ":hourglass:",
    "requeued": ":repeat:",
    "timeout": ":alarm_clock:",
    "resubmitted": ":arrows_counterclockwise:",
    "gave_up": ":no_entry:",
    "completed": ":white_check_mark:",
    "cancelled": ":heavy_multiplication_x:",
    "preflight_failed": ":warning:",
}

_QUEUE_FORMAT = "runner.alerts.queue/1"
_REDACTED = "[webhook URL redacted]"
_SLACK_HOOK_RE = re.compile(r"(?:https?://)?hooks\.slack(?:-gov)?\.com/[^\s\"'<>`|)\]]*", re.I)
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


class AlertConfigError(RunnerError):
    """The alerts section or the webhook URL source is unusable (one line, with a hint)."""


@dataclasses.dataclass
class Alert:
    """One event of one run, everything a person needs to decide what to do."""

    event: str
    run: str
    run_dir: str = ""
    job_id: str = ""
    attempt: int = 1
    nodes: str = ""
    exit_code: int | None = None
    slurm_state: str | None = None
    cause: str | None = None
    log_tail: list[str] = dataclasses.field(default_factory=list)
    next_step: str = ""
    extra: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown alert event {self.event!r}; expected one of {', '.join(EVENTS)}")
        # Callers pass Paths, ints and Nones from sacct/env; the payload wants plain JSON values.
        self.run_dir = os.fspath(self.run_dir)
        self.job_id = "" if self.job_id is None else str(self.job_id)
        self.attempt = int(self.attempt)
        self.nodes = "" if self.nodes is None else str(self.nodes)
        self.exit_code = None if self.exit_code is None else int(self.exit_code)
        self.log_tail = [str(line) for line in self.log_tail]
        self.extra = {str(k): str(v) for k, v in self.extra.items()}


# --------------------------------------------------------------------------------------- causes

_OOM_RE = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|OUT_OF_MEMORY|oom[-_ ]kill", re.I)
_NCCL_RE = re.compile(
    r"Watchdog caught collective operation timeout|NCCL error|NCCL communicator was aborted"
    r"|nccl(?:Unhandled\w*|System|Internal|Invalid\w*|Remote)Error"
)
_NODE_FAIL_RE = re.compile(r"NODE_FAIL|DUE TO NODE FAIL")
_TIME_LIMIT_RE = re.compile(r"DUE TO TIME LIMIT")
_PREEMPTED_RE = re.compile(r"DUE TO PREEMPTION|\bPREEMPTED\b")
# Output prefixes added by `srun --label` ("3: ") and torchrun ("[rank3]: ").
_PREFIX_RE = re.compile(r"^(?:\[(?:default)?rank\s*\d+\]:\s?|\d+:\s?)")
_EXC_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit)(?::\s|:$|$)")
_EXC_NAME_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::\s|:$|$)")

_DETAIL_LIMIT = 300


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _first_match(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    for line in lines:
        if pattern.search(line):
            return _clip(line.strip(), _DETAIL_LIMIT)
    return None


def _exception_line(lines: list[str]) -> str | None:
    """The exception line of the last traceback, else the last `XxxError: msg` line."""
    stripped = [_PREFIX_RE.sub("", line.rstrip()) for line in lines]
    tb = max((i for i, s in enumerate(stripped) if "Traceback (most recent call last)" in s), default=-1)
    if tb >= 0:
        # Frames are indented; the exception is the first unindented `Name: message` after the
        # header, preferably one named like an exception (other ranks' output may be interleaved).
        after = [s for s in stripped[tb + 1 :] if s and not s[0].isspace()]
        for pattern in (_EXC_RE, _EXC_NAME_RE):
            for s in after:
                if pattern.match(s):
                    return _clip(s, _DETAIL_LIMIT)
    for s in reversed(stripped):
        if _EXC_RE.match(s.strip()):
            return _clip(s.strip(), _DETAIL_LIMIT)
    return None


def guess_cause(log_lines: list[str], exit_code: int | None, slurm_state: str | None) -> str:
    """Name the most likely root cause, as `"<kind>: <evidence>"` or `"unknown"`.

    Kinds: OOM, node failure, time limit, preemption, NCCL timeout, Python exception.

    Why this order: an OOM on one rank makes the other ranks fail in NCCL, and a dead node or a
    Slurm kill (time limit, preemption) does the same, so those beat NCCL errors in the logs; a
    Slurm state or slurmstepd's "DUE TO ..." line is authoritative for how the job ended, and a
    Python traceback is usually the symptom of any of the above, so it comes last.
    """
    lines = [str(line) for line in log_lines]
    state = (slurm_state or "").strip().split(" ")[0].upper()

    oom = _first_match(_OOM_RE, lines)
    if oom or state == "OUT_OF_MEMORY":
        return f"OOM: {oom or 'Slurm state OUT_OF_MEMORY'}"
    node = _first_match(_NODE_FAIL_RE, lines)
    if state == "NODE_FAIL" or node:
        return f"node failure: {node or 'Slurm state NODE_FAIL'}"
    limit = _first_match(_TIME_LIMIT_RE, lines)
    if state == "TIMEOUT" or limit:
        return f"time limit: {limit or 'Slurm state TIMEOUT'}"
    preempted = _first_match(_PREEMPTED_RE, lines)
    if state == "PREEMPTED" or preempted:
        return f"preemption: {preempted or 'Slurm state PREEMPTED'}"
    nccl = _first_match(_NCCL_RE, lines)
    if nccl:
        return f"NCCL timeout: {nccl}"
    exc = _exception_line(lines)
    if exc:
        return f"Python exception: {exc}"
    return "unknown"


# Lower is a stronger signal that this rank's log shows the root cause.
_CAUSE_RANK = {
    "OOM": 0,
    "node failure": 1,
    "time limit": 2,
    "preemption": 3,
    "NCCL timeout": 4,
    "Python exception": 5,
}


# ------------------------------------------------------------------------------------ redaction


def _secret_variants(secrets: Iterable[str]) -> list[str]:
    variants: set[str] = set()
    for secret in secrets:
        if not secret:
            continue
        variants.add(secret)
        parts = urlsplit(secret)
        if parts.netloc:
            # requests and urllib name the host and the path separately in their messages.
            variants.add(secret.split("://", 1)[-1])
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            if len(path) >= 8:
                variants.add(path)
    return sorted(variants, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """Replace every Slack webhook URL and every given secret (and its path part) in text."""
    for variant in _secret_variants(secrets):
        text = text.replace(variant, _REDACTED)
    return _SLACK_HOOK_RE.sub(_REDACTED, text)


def _redact_obj(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, str):
        return redact(obj, secrets)
    if isinstance(obj, list):
        return [_redact_obj(item, secrets) for item in obj]
    if isinstance(obj, dict):
        return {redact(str(k), secrets): _redact_obj(v, secrets) for k, v in obj.items()}
    return obj


def _redacted_alert(alert: Alert, secrets: Iterable[str]) -> Alert:
    data = _redact_obj(dataclasses.asdict(alert), list(secrets))
    return Alert(**data)


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
    return {"type": "mrkdwn", "text": head + _clip(_mrkdwn(shown), SLACK_FIELD_LIMIT - len(head))}


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
    a = _redacted_alert(alert, secrets)
    state = f"{'—' if a.exit_code is None else a.exit_code} / {a.slurm_state or '—'}"
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": _clip(f"{_EMOJI[a.event]} {a.run} {_TITLES[a.event]}", SLACK_HEADER_LIMIT),
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
                _field("Cause", a.cause),
            ],
        },
    ]
    if a.extra:
        lines = "\n".join(f"*{_mrkdwn(k)}*: {_mrkdwn(v)}" for k, v in a.extra.items())
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _clip(lines, SLACK_SECTION_LIMIT)}})
    if a.log_tail:
        blocks.append(_code_section(a.log_tail))
    context = f"*Next:* {_mrkdwn(a.next_step or NEXT_STEPS[a.event])}"
    if a.run_dir:
        context += f"  ·  run dir `{_mrkdwn(a.run_dir)}`"
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _clip(context, SLACK_FIELD_LIMIT)}]})
    return {"text": _clip(_mrkdwn(_summary(a)), SLACK_SECTION_LIMIT), "blocks": blocks}


def json_payload(alert: Alert, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """Every Alert field as plain JSON, plus `source`, `title` and a one-line `text`."""
    a = _redacted_alert(alert, secrets)
    body: dict[str, Any] = {"source": "runner", "title": f"{a.run} {_TITLES[a.event]}", "text": _summary(a)}
    body.update(dataclasses.asdict(a))
    if not body["next_step"]:
        body["next_step"] = NEXT_STEPS[a.event]
    return body


def render_payload(alert: Alert, kind: str, *, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The body for a webhook of `kind` ("slack" or "json")."""
    if kind == "slack":
        return slack_payload(alert, secrets=secrets)
    if kind == "json":
        return json_payload(alert, secrets=secrets)
    raise ValueError(f"unknown alerts kind {kind!r}; expected one of {', '.join(KINDS)}")


# --------------------------------------------------------------------------------------- config


def validate_config(section: Mapping[str, Any] | None) -> list[str]:
    """Problems with an `alerts:` section, one line each (empty when it is valid)."""
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [f"alerts: expected a mapping, got {type(section).__name__}"]
    problems = [
        f"alerts.{key}: unknown key; expected one of {', '.join(DEFAULTS)}" for key in section if key not in DEFAULTS
    ]

    def check(key: str, ok: bool, expected: str) -> None:
        if key in section and not ok:
            problems.append(f"alerts.{key}: expected {expected}, got {section[key]!r}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

    check("enabled", isinstance(section.get("enabled"), bool), "true or false")
    check("kind", section.get("kind") in KINDS, " or ".join(repr(k) for k in KINDS))
    check("url_env", isinstance(section.get("url_env"), str) and bool(section.get("url_env")), "a variable name")
    check("url_file", section.get("url_file") is None or isinstance(section.get("url_file"), str), "a path or null")
    events = section.get("events")
    check(
        "events",
        isinstance(events, list) and all(isinstance(e, str) and e in EVENTS for e in events),
        f"a list of events from {', '.join(EVENTS)}",
    )
    check("timeout_s", number(section.get("timeout_s")) and section.get("timeout_s", 0) > 0, "a number > 0")
    retries = section.get("retries")
    check("retries", isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0, "an integer >= 0")
    check("backoff_s", number(section.get("backoff_s")), "a number >= 0")
    return problems


def _section(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """DEFAULTS overlaid with the alerts section (a whole config with an `alerts` key works too)."""
    if cfg is not None and "alerts" in cfg:
        cfg = cfg["alerts"] or {}
    merged = dict(DEFAULTS)
    merged.update({k: v for k, v in (cfg or {}).items() if k in DEFAULTS and v is not None})  # None: default
    return merged


def resolve_url(cfg: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """The webhook URL, or (None, why alerts are off).

    Raises:
        AlertConfigError: url_file is set but missing, unreadable, open to other users, or holds no
            http(s) URL. The message names the file, never its content.
    """
    c = _section(cfg)
    if not c["enabled"]:
        return None, "alerts are disabled in the config"
    env_name = c["url_env"]
    url = os.environ.get(env_name, "").strip()
    source = f"${env_name}"
    if not url and c["url_file"]:
        path = Path(os.path.expanduser(str(c["url_file"])))
        source = str(path)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            why = exc.strerror or "cannot stat it"
            raise AlertConfigError(
                f"alerts url_file {path}: {why}; put the webhook URL in it and run `chmod 600 {path}`"
            ) from None
        if mode & 0o077:
            raise AlertConfigError(
                f"alerts url_file {path} is open to other users (mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise AlertConfigError(f"alerts url_file {path}: cannot read it ({why})") from None
        url = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
        if not url:
            raise AlertConfigError(f"alerts url_file {path} is empty; put the webhook URL on its first line")
    if not url:
        return None, f"no webhook URL (${env_name} is unset and no url_file is configured)"
    if not re.match(r"https?://[^/\s]+", url):
        raise AlertConfigError(f"alerts webhook URL from {source} does not start with http:// or https://")
    return url, ""


# ------------------------------------------------------------------------------------- delivery


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _http_post(url: str, body: bytes, timeout: float) -> tuple[int, str | None, str]:
    """POST JSON once; (status, Retry-After header, start of the response body). No redirects."""
    headers = {"Content-Type": "application/json; charset=utf-8", "User-Agent": "runner-alerts"}
    try:
        import requests
    except ImportError:
        requests = None  # type: ignore[assignment]
    if requests is not None:
        resp = requests.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
        with contextlib.closing(resp):
            return resp.status_code, resp.headers.get("Retry-After"), resp.text[:200]

    import urllib.error
    import urllib.request

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(_NoRedirect)
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Retry-After"), resp.read(200).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            return exc.code, exc.headers.get("Retry-After"), exc.read(200).decode("utf-8", "replace")


def _retriable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


@dataclasses.dataclass
class _Outcome:
    ok: bool
    problem: str = ""
    attempts: int = 0
    rejected: bool = False  # the server refused this payload (4xx): retrying it cannot help


def _deliver(url: str, payload: Mapping[str, Any], c: Mapping[str, Any], deadline: float) -> _Outcome:
    body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    attempts = 1 + max(0, int(c["retries"]))
    backoff = max(0.0, float(c["backoff_s"]))
    problem = ""
    for i in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _Outcome(False, f"{problem}; no time left" if problem else "no time left", i)
        retry_after: float | None = None
        try:
            status, retry_after_header, text = _http_post(url, body, min(float(c["timeout_s"]), remaining))
        except Exception as exc:  # any transport failure is retried; its text may hold the URL
            problem = type(exc).__name__
        else:
            if 200 <= status < 300:
                return _Outcome(True, f"HTTP {status}", i + 1)
            said = " ".join(redact(text, [url]).split())[:80]
            problem = f"HTTP {status}" + (f" {said!r}" if said else "")
            if not _retriable(status):
                return _Outcome(False, problem + ", not retried", i + 1, rejected=400 <= status < 500)
            if status in (429, 503):
                retry_after = _parse_retry_after(retry_after_header)
        if i == attempts - 1:
            return _Outcome(False, problem, attempts)
        delay = backoff * 2**i if retry_after is None else min(retry_after, RETRY_AFTER_CAP_S)
        if time.monotonic() + delay >= deadline:
            return _Outcome(False, problem + f"; next try in {delay:g}s would pass the time limit", i + 1)
        time.sleep(delay)
    return _Outcome(False, problem, attempts)


def _log(message: str, secrets: Iterable[str] = ()) -> None:
    print(f"runner alerts: {redact(message, secrets)}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- queue


def queue_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where undelivered alerts wait: RUN_DIR/alerts/queue/."""
    return Path(run_dir) / "alerts" / "queue"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _queue_name(ns: int, event: str) -> str:
    stamp = datetime.fromtimestamp(ns // 1_000_000_000, timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}.{ns % 1_000_000_000:09d}Z-{event}.json"


def _enqueue(run_dir: str | os.PathLike[str], alert: Alert, kind: str, payload: Mapping[str, Any]) -> Path:
    """Write one queue entry atomically (tmp + fsync + hard link, never overwriting); names sort by time."""
    qdir = queue_dir(run_dir)
    qdir.mkdir(parents=True, exist_ok=True)
    entry = {
        "format": _QUEUE_FORMAT,
        "queued_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "event": alert.event,
        "kind": kind,
        "alert": dataclasses.asdict(alert),
        "payload": payload,
    }
    fd, tmp_name = tempfile.mkstemp(dir=qdir, prefix=".tmp-", suffix=".json")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entry, fh, ensure_ascii=False, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        ns = time.time_ns()
        while True:
            final = qdir / _queue_name(ns, alert.event)
            try:
                os.link(tmp, final)
            except FileExistsError:
                ns += 1
                continue
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if final.exists():  # no hard links here: the rename below could overwrite
                    ns += 1
                    continue
                os.replace(tmp, final)
            break
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(qdir)
    return final


def _queued(run_dir: str | os.PathLike[str]) -> list[Path]:
    qdir = queue_dir(run_dir)
    try:
        return sorted(p for p in qdir.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return []


@contextlib.contextmanager
def _queue_lock(run_dir: str | os.PathLike[str]) -> Iterator[bool]:
    """Non-blocking exclusive lock so the trap and cron never send the same entry twice."""
    qdir = queue_dir(run_dir)
    try:
        fd = os.open(qdir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield True  # cannot lock (read-only dir?): sending without the lock beats not sending
        return
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except BlockingIOError:
        locked = False
    except OSError:
        locked = True  # a filesystem without locks: as above
    try:
        yield locked
    finally:
        os.close(fd)


def _set_aside(path: Path, why: str) -> None:
    """Move an entry that can never be delivered out of the queue, so it stops blocking the others."""
    dest = path.parent.parent / "rejected"
    with contextlib.suppress(OSError):
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest / path.name)
        _log(f"queued alert {path.name} set aside in {dest} ({why})")


def _late_payload(entry: Mapping[str, Any], kind: str, url: str) -> dict[str, Any]:
    payload = entry.get("payload")
    alert_data = entry.get("alert")
    if (entry.get("kind") != kind or not isinstance(payload, dict)) and isinstance(alert_data, dict):
        payload = render_payload(Alert(**alert_data), kind)
    if not isinstance(payload, dict):
        raise ValueError("entry has no payload")
    payload = dict(_redact_obj(payload, [url]))
    queued_at = str(entry.get("queued_at", "?"))
    if kind == "slack" and isinstance(payload.get("blocks"), list):
        note = f"Queued at {queued_at}: the webhook was unreachable then."
        payload["blocks"].append({"type": "context", "elements": [{"type": "mrkdwn", "text": note}]})
    else:
        payload["queued_at"] = queued_at
    return payload


def _flush(run_dir: str | os.PathLike[str], c: Mapping[str, Any], url: str, deadline: float) -> tuple[int, int, str]:
    """(sent, left, why the first one left was not sent); the caller writes the one stderr line."""
    with _queue_lock(run_dir) as locked:
        pending = _queued(run_dir)
        if not locked:
            return 0, len(pending), "another process is flushing the queue"
        sent = 0
        for path in pending:
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                payload = _late_payload(entry, c["kind"], url)
            except FileNotFoundError:
                continue  # delivered by a flush that did not take the lock
            except (OSError, ValueError, TypeError) as exc:
                _set_aside(path, f"unreadable: {type(exc).__name__}")
                continue
            outcome = _deliver(url, payload, c, deadline)
            if outcome.ok:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                sent += 1
                continue
            if outcome.rejected and outcome.problem.startswith(("HTTP 400", "HTTP 413", "HTTP 422")):
                _set_aside(path, outcome.problem)  # this payload is bad, the others may be fine
                continue
            return sent, len(_queued(run_dir)), outcome.problem
        return sent, len(_queued(run_dir)), ""


def flush_queue(run_dir: str | os.PathLike[str], cfg: Mapping[str, Any] | None) -> tuple[int, int]:
    """Send queued alerts oldest first, removing each once delivered; stops at the first failure.

    Returns:
        (sent, left): how many were delivered now and how many are still queued. Never raises.
    """
    try:
        if not _queued(run_dir):
            return 0, 0
        c = _section(cfg)
        try:
            url, _ = resolve_url(c)
        except AlertConfigError as exc:
            _log(str(exc))
            return 0, len(_queued(run_dir))
        if url is None:
            return 0, len(_queued(run_dir))
        try:
            sent, left, problem = _flush(run_dir, c, url, time.monotonic() + MAX_TOTAL_S)
        except Exception as exc:  # an alert must never break the caller
            _log(f"flushing queued alerts failed: {type(exc).__name__}: {exc}", [url])
            return 0, len(_queued(run_dir))
        if left:
            _log(f"{left} queued alerts not delivered ({problem}); they stay in {queue_dir(run_dir)}", [url])
        return sent, left
    except Exception as exc:
        _log(f"flushing queued alerts failed: {type(exc).__name__}")
        return 0, 0


def send(
    alert: Alert,
    cfg: Mapping[str, Any] | None,
    run_dir: str | os.PathLike[str],
    *,
    budget_s: float | None = None,
) -> bool:
    """Deliver one alert now if possible; True only when the webhook accepted it.

    Events not in cfg["events"], disabled alerts and a missing URL return False quietly. Otherwise,
    after the retries (or when the URL source is misconfigured) the payload is queued under
    run_dir/alerts/queue/ and one line goes to stderr. Older queued alerts are flushed first so the
    receiver sees events in order; while they cannot be delivered the new one joins the queue
    without another try. Never raises.

    Args:
        budget_s: upper bound on the time spent here (default MAX_TOTAL_S); a trap with a few
            seconds before SIGKILL passes less.
    """
    url: str | None = None
    try:
        c = _section(cfg)
        if not c["enabled"] or alert.event not in c["events"]:
            return False
        deadline = time.monotonic() + (MAX_TOTAL_S if budget_s is None else max(0.0, budget_s))
        try:
            url, _ = resolve_url(c)
        except AlertConfigError as exc:
            problem = str(exc)
        else:
            if url is None:
                return False
            problem = ""
            if _queued(run_dir):
                _, left, why = _flush(run_dir, c, url, deadline)
                if left:
                    problem = f"{left} older alerts still queued: {why}"
            if not problem:
                outcome = _deliver(url, render_payload(alert, c["kind"], secrets=[url]), c, deadline)
                if outcome.ok:
                    return True
                problem = f"{outcome.problem} after {outcome.attempts} tries"
        secrets = [url] if url else []
        safe = _redacted_alert(alert, secrets)
        path = _enqueue(run_dir, safe, c["kind"], render_payload(safe, c["kind"]))
        _log(f"{alert.event} alert for {alert.run} not delivered ({problem}); queued as {path}", secrets)
    except Exception as exc:  # a failing alert never fails the job
        with contextlib.suppress(Exception):
            _log(f"{alert.event} alert for {alert.run} lost: {type(exc).__name__}", [url] if url else [])
    return False


# ------------------------------------------------------------------------------------- run logs

_SCAN_BYTES = 256 * 1024
_LINE_LIMIT = 500


def _read_tail(path: Path) -> list[str]:
    """The last lines of a log, as a terminal would show them (progress-bar \\r rewrites collapsed)."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - _SCAN_BYTES))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").split("\n")
    if size > _SCAN_BYTES:
        lines = lines[1:]  # the first one is cut in the middle
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for line in lines:
        line = _ANSI_RE.sub("", line.rstrip("\r").rsplit("\r", 1)[-1])
        out.append(_clip(line, _LINE_LIMIT))
    return out


def _rank_of(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem)
    return int(digits[-1]) if digits else 1 << 30


def _pick_rank_log(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The rank log of the newest attempt that best shows what went wrong, else rank 0's."""
    logs = [p for p in (run_dir / "logs").rglob("rank-*.log") if p.is_file()]
    if not logs:
        return None, []
    # One directory per attempt, or all in logs/: take the directory written to last.
    newest_dir = max(logs, key=lambda p: p.stat().st_mtime).parent
    logs = sorted((p for p in logs if p.parent == newest_dir), key=lambda p: (_rank_of(p), p.name))
    tails = [_read_tail(p) for p in logs]

    def score(lines: list[str]) -> int:
        kind = guess_cause(lines[-CAUSE_LINES:], None, None).split(":", 1)[0]
        if kind in _CAUSE_RANK:
            return _CAUSE_RANK[kind]
        if any("Traceback" in ln or re.search(r"\berror\b", ln, re.I) for ln in lines[-CAUSE_LINES:]):
            return len(_CAUSE_RANK)
        return len(_CAUSE_RANK) + 1  # no sign of trouble: rank 0 (the first) wins the tie

    best = min(range(len(logs)), key=lambda i: (score(tails[i]), i))
    return logs[best], tails[best]


def alert_from_run(run_dir: str | os.PathLike[str], event: str, **fields: Any) -> Alert:
    """An Alert for a run directory, its log tail and cause taken from the rank logs.

    Looks at RUN_DIR/logs/**/rank-*.log of the newest attempt directory; the log with the strongest
    sign of failure (OOM > node failure > time limit > preemption > NCCL > traceback/error) wins,
    lowest rank on ties, rank 0 when none shows an error. Any Alert field may be given in `fields`
    and wins over what is found; `job_id` and `nodes` default to $SLURM_JOB_ID and
    $SLURM_JOB_NODELIST, `run` to the directory name, `cause` to guess_cause() (None for
    "completed"), `next_step` to NEXT_STEPS[event]. extra["log"] names the log used.
    """
    names = {f.name for f in dataclasses.fields(Alert)} - {"event", "run_dir"}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"alert_from_run() got unknown fields: {', '.join(unknown)}")
    root = Path(run_dir)
    log_path, lines = _pick_rank_log(root)
    values: dict[str, Any] = {
        "run": root.resolve().name,
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "nodes": os.environ.get("SLURM_JOB_NODELIST", ""),
        "log_tail": lines[-TAIL_LINES:],
        "next_step": NEXT_STEPS.get(event, ""),
    }
    values.update(fields)
    if "cause" not in fields and event != "completed":
        values["cause"] = guess_cause(lines[-CAUSE_LINES:], values.get("exit_code"), values.get("slurm_state"))
    extra = dict(values.get("extra") or {})
    if log_path is not None:
        extra.setdefault("log", str(log_path.relative_to(root)))
    values["extra"] = extra
    return Alert(event=event, run_dir=os.fspath(run_dir), **values)


def notify(run_dir: str | os.PathLike[str], cfg: Mapping[str, Any] | None, event: str, budget_s: float = 15.0,
           **fields: Any) -> bool:
    """Alert about a run directory (log tail and cause from its logs); never raises, queues what fails."""
    return send(alert_from_run(run_dir, event, **fields), cfg, run_dir, budget_s=budget_s)
