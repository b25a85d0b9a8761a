"""Getting an alert to the webhook: the URL, the POST with retries, and the on-disk queue of what failed.

Runs on the login node (``runner cron``, resubmission), in the batch script's exit hook and in a local run.
A failing alert must never fail the job: ``send`` and ``flush_queue`` catch everything, log at most one
warning and keep undelivered alerts in ``RUN_DIR/alerts/queue/`` for a later ``flush_queue`` (called by
``runner cron``, and by ``send`` itself before a new alert so the order is kept).

The webhook URL is a secret (a Slack URL is a write token). It is read only at the moment of sending and
never lands in an exception, a log line, printed output or a queue file. Every function takes the validated
``alerts:`` section of a config (``runner.spec`` fills its defaults).
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import errno
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from runner.alerts.causes import alert_from_run
from runner.alerts.payload import Alert, fallback_payload, redact, redact_obj, redacted_alert, render_payload
from runner.errors import RunnerError
from runner.ledger import AlertEvent
from runner.rundir import RunDir, Unreadable, locked, read_regular

log = logging.getLogger(__name__)

# Bounds that are not worth a config key: a server may ask for long pauses, but the caller (often a
# trap with a few seconds before SIGKILL) must get control back; what is not sent is queued.
RETRY_AFTER_CAP_S = 60.0
MAX_TOTAL_S = 60.0
URL_FILE_MAX = 64 << 10  # a webhook URL file: one URL and a few comment lines

_QUEUE_FORMAT = "runner.alerts.queue/1"


class AlertConfigError(RunnerError):
    """The webhook URL source is unusable (one line, with a hint)."""


def _warn(message: str, secrets: Iterable[str] = ()) -> None:
    log.warning("%s", redact(message, secrets))


# ------------------------------------------------------------------------------------------- URL


def _check_private(path: Path) -> None:
    """The URL file is the user's alone: owned by them, no group/other bits, in a directory others cannot write
    (where they could swap the file for their own). One line each, naming the file, never its content."""
    st, parent = path.stat(), path.resolve().parent
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read below for ever: refused from its stat
        raise AlertConfigError(f"alerts url_file {path}: found no regular file (a FIFO, device or directory); "
                               "expected a file holding the webhook URL. hint: write the URL into a plain file")
    if st.st_uid != os.getuid():
        raise AlertConfigError(f"alerts url_file {path}: found it owned by uid {st.st_uid}; expected your own "
                               f"(uid {os.getuid()}). hint: copy it into a file of yours and `chmod 600` it")
    if st.st_mode & 0o077:
        raise AlertConfigError(f"alerts url_file {path}: found mode {stat.S_IMODE(st.st_mode):04o}; expected 0600 "
                               f"(no group or other bits). hint: run `chmod 600 {path}`")
    dst = parent.stat()
    if dst.st_uid not in (os.getuid(), 0) or dst.st_mode & 0o022:
        raise AlertConfigError(f"alerts url_file {path}: found its directory {parent} writable by others (mode "
                               f"{stat.S_IMODE(dst.st_mode):04o}, uid {dst.st_uid}); expected a directory only you "
                               "can write. hint: keep the file in e.g. ~/.config/runner/ (mode 0700)")


def secrets_of(section: Mapping[str, Any]) -> list[str]:
    """The webhook URL if one is configured and readable (to redact it), else nothing; never raises."""
    try:
        url, _ = resolve_url(section)
    except Exception:
        return []
    return [url] if url else []


def resolve_url(section: Mapping[str, Any]) -> tuple[str | None, str]:
    """The webhook URL, or (None, why alerts are off).

    Raises:
        AlertConfigError: url_file is set but missing, unreadable, open to other users, or holds no
            http(s) URL. The message names the file, never its content.
    """
    if not section["enabled"]:
        return None, "alerts are disabled in the config"
    env_name = section["url_env"]
    url = os.environ.get(env_name, "").strip()
    source = f"${env_name}"
    if not url and section["url_file"]:
        path = Path(os.path.expanduser(str(section["url_file"])))
        source = str(path)
        try:
            _check_private(path)
        except OSError as exc:
            why = exc.strerror or "cannot stat it"
            raise AlertConfigError(
                f"alerts url_file {path}: {why}; put the webhook URL in it and run `chmod 600 {path}`"
            ) from None
        try:
            text = read_regular(path, URL_FILE_MAX).decode("utf-8")
        except Unreadable as exc:
            raise AlertConfigError(f"alerts url_file {path}: {exc.found}; expected a small file holding the "
                                   "webhook URL") from None
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


# ------------------------------------------------------------------------------------------- POST


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
    import requests  # here, not at the top: every `runner` command imports alerts, few of them send

    headers = {"Content-Type": "application/json; charset=utf-8", "User-Agent": "runner-alerts"}
    resp = requests.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
    with contextlib.closing(resp):
        return resp.status_code, resp.headers.get("Retry-After"), resp.text[:200]


def _retriable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


@dataclasses.dataclass
class _Outcome:
    ok: bool
    problem: str = ""
    attempts: int = 0
    rejected: bool = False  # the server refused this payload (4xx): retrying it cannot help


def _deliver(url: str, payload: Mapping[str, Any], section: Mapping[str, Any], deadline: float) -> _Outcome:
    body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    attempts = 1 + section["retries"]
    backoff = float(section["backoff_s"])
    problem = ""
    for i in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _Outcome(False, f"{problem}; no time left" if problem else "no time left", i)
        retry_after: float | None = None
        try:
            status, retry_after_header, text = _http_post(url, body, min(float(section["timeout_s"]), remaining))
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


# ------------------------------------------------------------------------------------------ queue


def queue_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Where undelivered alerts wait: RUN_DIR/alerts/queue/."""
    return RunDir(Path(run_dir)).alert_queue


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


def sent_log(run_dir: str | os.PathLike[str]) -> Path:
    """One line per delivered alert (what it said, redacted), for ``runner report``: RUN_DIR/alerts/sent.jsonl."""
    return RunDir(Path(run_dir)).alerts_sent


def _record_sent(run_dir: str | os.PathLike[str], alert: Mapping[str, Any], secrets: list[str]) -> None:
    """Append what a delivered alert said; a failure here never fails the alert (it was sent)."""
    with contextlib.suppress(Exception):
        keep = ("event", "run", "job_id", "attempt", "nodes", "exit_code", "cause", "next_step")
        line = {"time": round(time.time(), 3), **{k: alert.get(k) for k in keep}}
        path = sent_log(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(redact_obj(line, secrets), ensure_ascii=False) + "\n")


def _queued(run_dir: str | os.PathLike[str]) -> list[Path]:
    qdir = queue_dir(run_dir)
    try:
        return sorted(p for p in qdir.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    except OSError:
        return []


def _set_aside(path: Path, why: str) -> None:
    """Move an entry that can never be delivered out of the queue, so it stops blocking the others."""
    dest = RunDir(path.parent.parent.parent).alerts_rejected  # path: RUN_DIR/alerts/queue/<entry>
    with contextlib.suppress(OSError):
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest / path.name)
        _warn(f"queued alert {path.name} set aside in {dest} ({why})")


def _late_payload(entry: Mapping[str, Any], kind: str, url: str) -> dict[str, Any]:
    payload = entry.get("payload")
    alert_data = entry.get("alert")
    if (entry.get("kind") != kind or not isinstance(payload, dict)) and isinstance(alert_data, dict):
        payload = render_payload(Alert(**alert_data), kind)
    if not isinstance(payload, dict):
        raise ValueError("entry has no payload")
    payload = dict(redact_obj(payload, [url]))
    queued_at = str(entry.get("queued_at", "?"))
    if kind == "slack" and isinstance(payload.get("blocks"), list):
        note = f"Queued at {queued_at}: the webhook was unreachable then."
        payload["blocks"].append({"type": "context", "elements": [{"type": "mrkdwn", "text": note}]})
    else:
        payload["queued_at"] = queued_at
    return payload


def _flush(run_dir: str | os.PathLike[str], section: Mapping[str, Any], url: str,
           deadline: float) -> tuple[int, int, str]:
    """(sent, left, why the first one left was not sent); the caller logs the one warning."""
    # One flush at a time, so the trap and cron never send an entry twice; where no lock can be taken (a
    # read-only folder, a filesystem without locks) sending without it beats not sending.
    with locked(queue_dir(run_dir) / ".lock", blocking=False, fail_open=True) as held:
        pending = _queued(run_dir)
        if not held:
            return 0, len(pending), "another process is flushing the queue"
        sent = 0
        for path in pending:
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                payload = _late_payload(entry, section["kind"], url)
            except FileNotFoundError:
                continue  # delivered by a flush that did not take the lock
            except (OSError, ValueError, TypeError) as exc:
                _set_aside(path, f"unreadable: {type(exc).__name__}")
                continue
            outcome = _deliver(url, payload, section, deadline)
            if outcome.ok:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                _record_sent(run_dir, entry.get("alert") if isinstance(entry.get("alert"), dict) else {}, [url])
                sent += 1
                continue
            if outcome.rejected and outcome.problem.startswith(("HTTP 400", "HTTP 413", "HTTP 422")):
                _set_aside(path, outcome.problem)  # this payload is bad, the others may be fine
                continue
            return sent, len(_queued(run_dir)), outcome.problem
        return sent, len(_queued(run_dir)), ""


def flush_queue(run_dir: str | os.PathLike[str], section: Mapping[str, Any],
                budget_s: float = MAX_TOTAL_S) -> tuple[int, int]:
    """Send queued alerts oldest first, removing each once delivered; stops at the first failure or after
    ``budget_s`` seconds.

    Returns:
        (sent, left): how many were delivered now and how many are still queued. Never raises.
    """
    try:
        if not _queued(run_dir):
            return 0, 0
        try:
            url, _ = resolve_url(section)
        except AlertConfigError as exc:
            _warn(str(exc))
            return 0, len(_queued(run_dir))
        if url is None:
            return 0, len(_queued(run_dir))
        try:
            sent, left, problem = _flush(run_dir, section, url, time.monotonic() + budget_s)
        except Exception as exc:  # an alert must never break the caller
            _warn(f"flushing queued alerts failed: {type(exc).__name__}: {exc}", [url])
            return 0, len(_queued(run_dir))
        if left:
            _warn(f"{left} queued alerts not delivered ({problem}); they stay in {queue_dir(run_dir)}", [url])
        return sent, left
    except Exception as exc:
        _warn(f"flushing queued alerts failed: {type(exc).__name__}")
        return 0, 0


# ------------------------------------------------------------------------------------------ one sender

_DEFERRED: list[bool] = []  # inside ``deferred()``: send() queues, a sender sends later


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within the block ``send`` (and so ``notify``) only queues, as ``enqueue`` does: for a caller that holds a lock
    or works through many runs (``runner cron``), and sends them afterwards with ``flush_many`` under one budget."""
    _DEFERRED.append(True)
    try:
        yield
    finally:
        _DEFERRED.pop()


def _transport_failure(problem: str) -> bool:
    """A failure of the webhook itself (no answer, refused, timed out), as opposed to one payload refused."""
    return not problem.startswith("HTTP 4")


def flush_many(queues: Iterable[tuple[str | os.PathLike[str], Mapping[str, Any]]],
               budget_s: float = MAX_TOTAL_S) -> tuple[int, int]:
    """Send the queued alerts of many runs, oldest run first, within ``budget_s`` seconds in total: one sender, one
    deadline, however many runs. A webhook that fails for one run (no answer, refused) is not tried again for the
    others in this pass: their alerts stay queued for the next one. Returns (sent, left). Never raises."""
    deadline = time.monotonic() + max(0.0, budget_s)
    dead: set[str] = set()
    sent = left = 0
    for run_dir, section in queues:
        try:
            pending = len(_queued(run_dir))
            if not pending:
                continue
            try:
                url, _ = resolve_url(section)
            except AlertConfigError as exc:
                _warn(str(exc))
                left += pending
                continue
            if url is None or url in dead or time.monotonic() >= deadline:
                left += pending
                continue
            n, rest, problem = _flush(run_dir, section, url, deadline)
            sent, left = sent + n, left + rest
            if rest and problem and _transport_failure(problem):
                dead.add(url)
            if rest:
                _warn(f"{rest} queued alerts of {Path(run_dir).name} not delivered ({problem}); they stay in "
                      f"{queue_dir(run_dir)}", [url])
        except Exception as exc:  # one run's queue never stops the others
            with contextlib.suppress(Exception):
                _warn(f"flushing queued alerts of {Path(run_dir).name} failed: {type(exc).__name__}")
    return sent, left


# ------------------------------------------------------------------------------------------ send


def _payload(alert: Alert, kind: str, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The body of ``alert`` for a webhook of ``kind``; when it cannot be built, a plain one that says so (and the
    error in the log, with its traceback): an alert is never dropped for a bug in how it looks."""
    secrets = list(secrets)
    try:
        return render_payload(alert, kind, secrets=secrets)
    except Exception as exc:
        log.error("%s", redact(f"the {alert.event} alert for {alert.run} could not be built ({type(exc).__name__}: "
                               f"{exc}); a plain one goes instead", secrets), exc_info=True)
        return fallback_payload(alert, kind, exc, secrets=secrets)


def send(
    alert: Alert,
    section: Mapping[str, Any],
    run_dir: str | os.PathLike[str],
    *,
    budget_s: float | None = None,
) -> bool:
    """Deliver one alert now if possible; True only when the webhook accepted it.

    Events not in section["events"], disabled alerts and a missing URL return False quietly. Otherwise,
    after the retries (or when the URL source is misconfigured) the payload is queued under
    run_dir/alerts/queue/ and one warning is logged. Older queued alerts are flushed first so the
    receiver sees events in order; while they cannot be delivered the new one joins the queue
    without another try. Never raises.

    Args:
        budget_s: upper bound on the time spent here (default MAX_TOTAL_S); a trap with a few
            seconds before SIGKILL passes less.
    """
    url: str | None = None
    try:
        if not section["enabled"] or alert.event not in section["events"]:
            return False
        deadline = time.monotonic() + (MAX_TOTAL_S if budget_s is None else max(0.0, budget_s))
        try:
            url, _ = resolve_url(section)
        except AlertConfigError as exc:
            problem = str(exc)
        else:
            if url is None:
                return False
            if _DEFERRED:  # the caller's sender sends it, after its pass
                safe = redacted_alert(alert, [url])
                _enqueue(run_dir, safe, section["kind"], _payload(safe, section["kind"]))
                return False
            problem = ""
            if _queued(run_dir):
                _, left, why = _flush(run_dir, section, url, deadline)
                if left:
                    problem = f"{left} older alerts still queued: {why}"
            if not problem:
                outcome = _deliver(url, _payload(alert, section["kind"], [url]), section, deadline)
                if outcome.ok:
                    _record_sent(run_dir, dataclasses.asdict(alert), [url])
                    return True
                problem = f"{outcome.problem} after {outcome.attempts} tries"
        secrets = [url] if url else []
        safe = redacted_alert(alert, secrets)
        path = _enqueue(run_dir, safe, section["kind"], _payload(safe, section["kind"]))
        _warn(f"{alert.event} alert for {alert.run} not delivered ({problem}); queued as {path}", secrets)
    except Exception as exc:  # a failing alert never fails the job
        with contextlib.suppress(Exception):
            _warn(f"{alert.event} alert for {alert.run} lost: {type(exc).__name__}: {exc}", [url] if url else [])
    return False


def enqueue(run_dir: str | os.PathLike[str], section: Mapping[str, Any], alerts: Iterable[Alert]) -> int:
    """Put alerts in the run's queue, in order, redacted, to be sent by ``send_later`` (or ``runner cron``).

    For a caller that must not wait on the network (the exit hook, seconds before Slurm ends the job). Alerts
    that would not be sent (disabled, event not selected, no URL) are left out; returns how many were queued.
    Never raises.
    """
    n = 0
    try:
        if not section["enabled"]:
            return 0
        try:
            url, _ = resolve_url(section)
        except AlertConfigError as exc:  # queued anyway: cron sends them once the URL source is fixed
            _warn(str(exc))
            url = ""
        if url is None:
            return 0
        secrets = [url] if url else []
        for alert in alerts:
            if alert.event in section["events"]:
                safe = redacted_alert(alert, secrets)
                _enqueue(run_dir, safe, section["kind"], _payload(safe, section["kind"]))
                n += 1
    except Exception as exc:  # a failing alert never fails the job
        with contextlib.suppress(Exception):
            _warn(f"queueing alerts failed: {type(exc).__name__}")
    return n


def notify(run_dir: str | os.PathLike[str], section: Mapping[str, Any], event: AlertEvent, budget_s: float = 15.0,
           **fields: Any) -> bool:
    """Alert about a run directory (log tail and cause from its latest attempt); never raises, queues what fails."""
    return send(alert_from_run(run_dir, event, **fields), section, run_dir, budget_s=budget_s)
