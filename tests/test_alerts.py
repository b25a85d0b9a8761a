"""Alerts against a real HTTP server on 127.0.0.1 (tests/webhook_server.py)."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from runner import alerts, spec
from runner.alerts import Alert, AlertConfigError, alert_from_run, flush_queue, guess_cause, nextstep, send
from runner.errors import ConfigError
from runner.rundir import RunDir
from runner.spec import EVENTS

pytestmark = pytest.mark.unit

if TYPE_CHECKING:
    from tests.webhook_server import WebhookServer

# Not imported directly: a module that pytest loads as a plugin must not be imported before.
REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"


@functools.cache
def _defaults() -> dict[str, Any]:
    return dict(spec.load(QUICKSTART).data["alerts"])


def section(**values: Any) -> dict[str, Any]:
    """An `alerts:` section as validation hands it to alerts: every key, the schema's defaults filled in."""
    return {**_defaults(), **values}


@pytest.fixture
def cfg(webhook: WebhookServer, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Fast settings, URL from the default environment variable."""
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    return section(timeout_s=2.0, retries=2, backoff_s=0.01)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines() or [""])


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The lines alerts log (its one warning per failure), whatever logging setup an earlier test left."""
    handler = _Lines()
    logger = logging.getLogger("runner.alerts")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def make_alert(event: str = "failed", **kw: Any) -> Alert:
    values: dict[str, Any] = {
        "run": "llama-7b",
        "run_dir": "/scratch/runs/llama-7b",
        "job_id": "4242",
        "attempt": 2,
        "nodes": "gpu[01-04]",
        "exit_code": 1,
        "slurm_state": "FAILED",
        "cause": "Python exception: RuntimeError: boom",
        "log_tail": ["step 10 loss 2.3", "Traceback (most recent call last):", "RuntimeError: boom"],
        "next_step": "Fix it.",
    }
    values.update(kw)
    return Alert(event=event, **values)


def queued(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "alerts" / "queue").glob("*.json"))


def all_text(run_dir: Path) -> str:
    return "".join(p.read_text() for p in run_dir.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------- delivery


def test_slack_block_kit_delivered(webhook, cfg, tmp_path, capfd, logged):
    assert send(make_alert(), cfg, tmp_path) is True

    [body] = webhook.wait_for(1)
    assert "llama-7b" in body["text"] and "boom" in body["text"]
    types = [b["type"] for b in body["blocks"]]
    assert types == ["header", "section", "section", "context"]
    header, fields, code, context = body["blocks"]
    assert header["text"]["type"] == "plain_text" and "llama-7b" in header["text"]["text"]
    labels = [f["text"].split("\n")[0] for f in fields["fields"]]
    assert labels == ["*Run*", "*Job ID*", "*Attempt*", "*Nodes*", "*Event*", "*Exit code / Slurm state*", "*Cause*"]
    values = [f["text"].split("\n", 1)[1] for f in fields["fields"]]
    assert values == [
        "llama-7b",
        "4242",
        "2",
        "gpu[01-04]",
        "failed",
        "1 / FAILED",
        "Python exception: RuntimeError: boom",
    ]
    assert "```\nstep 10 loss 2.3\nTraceback (most recent call last):\nRuntimeError: boom\n```" in code["text"]["text"]
    assert "Fix it." in context["elements"][0]["text"]
    assert webhook.requests[0].headers["Content-Type"].startswith("application/json")
    assert not queued(tmp_path)
    assert capfd.readouterr().err == "" and logged == []


def test_json_kind(webhook, cfg, tmp_path):
    cfg["kind"] = "json"
    assert send(make_alert("timeout", extra={"checkpoint": "step-100"}), cfg, tmp_path)
    [body] = webhook.wait_for(1)
    assert body["event"] == "timeout" and body["job_id"] == "4242" and body["attempt"] == 2
    assert body["log_tail"][-1] == "RuntimeError: boom" and body["extra"] == {"checkpoint": "step-100"}
    assert body["source"] == "runner" and body["exit_code"] == 1


def test_500_then_200_is_retried(webhook, cfg, tmp_path):
    webhook.set_responses([500, 502, 200])
    assert send(make_alert(), cfg, tmp_path) is True
    assert [r.status for r in webhook.requests] == [500, 502, 200]
    assert len(webhook.received) == 1
    assert not queued(tmp_path)


def test_429_retry_after_is_honoured(webhook, cfg, tmp_path):
    webhook.set_responses([webhook.Response(429, {"Retry-After": "1"}), 200])
    assert send(make_alert(), cfg, tmp_path) is True
    first, second = webhook.requests
    assert first.status == 429 and second.status == 200
    assert second.time - first.time >= 1.0


def test_retry_after_is_capped_by_the_time_budget(webhook, cfg, tmp_path, logged):
    webhook.set_responses([webhook.Response(429, {"Retry-After": "3600"})])
    started = time.monotonic()
    assert send(make_alert(), cfg, tmp_path, budget_s=2) is False
    assert time.monotonic() - started < 2
    assert len(webhook.requests) == 1 and len(queued(tmp_path)) == 1
    assert "HTTP 429" in "\n".join(logged)


def test_client_error_is_not_retried(webhook, cfg, tmp_path, logged):
    webhook.set_responses([webhook.Response(404, body="no_service")])
    assert send(make_alert(), cfg, tmp_path) is False
    assert len(webhook.requests) == 1
    assert len(queued(tmp_path)) == 1
    err = "\n".join(logged)
    assert "HTTP 404 'no_service'" in err and webhook.secret not in err


def test_slow_server_times_out_and_queues(webhook, cfg, tmp_path):
    cfg.update(timeout_s=0.2, retries=0)
    webhook.set_responses([webhook.Response(200, delay_s=1.0)])
    started = time.monotonic()
    assert send(make_alert(), cfg, tmp_path) is False
    assert time.monotonic() - started < 0.9
    assert len(queued(tmp_path)) == 1


def test_503_and_429_with_retry_after_0_are_retried(webhook, cfg, tmp_path):
    webhook.set_responses([503, webhook.Response(429, {"Retry-After": "0"}), 200])
    assert send(make_alert(), cfg, tmp_path) is True
    assert [r.status for r in webhook.requests] == [503, 429, 200]
    assert webhook.received[0]["blocks"][0]["type"] == "header"


# ------------------------------------------------------------------------------------------- queue


def test_server_down_queues_then_flush_delivers_in_order(webhook, cfg, tmp_path, logged):
    webhook.stop()
    for event in ("preempted", "requeued", "failed"):
        assert send(make_alert(event), cfg, tmp_path) is False
    files = queued(tmp_path)
    assert [p.name.rsplit("-", 1)[1] for p in files] == ["preempted.json", "requeued.json", "failed.json"]
    assert not list((tmp_path / "alerts" / "queue").glob(".tmp-*"))
    for path in files:
        entry = json.loads(path.read_text())
        assert entry["event"] in EVENTS and entry["kind"] == "slack" and "blocks" in entry["payload"]
    assert len(logged) == 3 and all("queued as" in line for line in logged)

    assert flush_queue(tmp_path, cfg) == (0, 3)  # still down: nothing lost
    assert len(queued(tmp_path)) == 3

    webhook.start()
    assert flush_queue(tmp_path, cfg) == (3, 0)
    bodies = webhook.wait_for(3)
    assert [b["blocks"][1]["fields"][4]["text"].split("\n")[1] for b in bodies] == ["preempted", "requeued", "failed"]
    assert all("Queued at" in b["blocks"][-1]["elements"][0]["text"] for b in bodies)
    assert queued(tmp_path) == []
    assert flush_queue(tmp_path, cfg) == (0, 0)


def test_send_flushes_older_alerts_first(webhook, cfg, tmp_path):
    webhook.stop()
    send(make_alert("preempted"), cfg, tmp_path)
    webhook.start()
    assert send(make_alert("completed"), cfg, tmp_path) is True
    events = [b["blocks"][1]["fields"][4]["text"].split("\n")[1] for b in webhook.wait_for(2)]
    assert events == ["preempted", "completed"]
    assert queued(tmp_path) == []


def test_flush_stops_at_first_failure_and_keeps_the_rest(webhook, cfg, tmp_path):
    webhook.stop()
    for event in ("preempted", "requeued", "failed"):
        send(make_alert(event), cfg, tmp_path)
    webhook.start()
    cfg["retries"] = 0
    webhook.set_responses([200, 500])
    assert flush_queue(tmp_path, cfg) == (1, 2)
    assert [p.name.rsplit("-", 1)[1] for p in queued(tmp_path)] == ["requeued.json", "failed.json"]
    assert flush_queue(tmp_path, cfg) == (2, 0)


def test_payload_rejected_on_flush_is_set_aside(webhook, cfg, tmp_path):
    webhook.stop()
    send(make_alert("preempted"), cfg, tmp_path)
    send(make_alert("failed"), cfg, tmp_path)
    webhook.start()
    webhook.set_responses([webhook.Response(400, body="invalid_blocks")])
    assert flush_queue(tmp_path, cfg) == (1, 0)
    assert len(list((tmp_path / "alerts" / "rejected").glob("*-preempted.json"))) == 1


def test_flush_with_json_kind_rerenders_queued_slack_entries(webhook, cfg, tmp_path):
    webhook.stop()
    send(make_alert("failed"), cfg, tmp_path)
    webhook.start()
    assert flush_queue(tmp_path, {**cfg, "kind": "json"}) == (1, 0)
    [body] = webhook.wait_for(1)
    assert body["event"] == "failed" and "queued_at" in body and "blocks" not in body


# --------------------------------------------------------------------------------- URL and secrets


def test_url_file_readable_by_others_is_rejected_in_one_line(webhook, tmp_path, monkeypatch, logged):
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    url_file = tmp_path / "hook.url"
    url_file.write_text(webhook.url + "\n")
    url_file.chmod(0o644)
    cfg = section(url_file=str(url_file), backoff_s=0.01)

    with pytest.raises(AlertConfigError) as info:
        alerts.resolve_url(cfg)
    message = str(info.value)
    assert "\n" not in message and str(url_file) in message and "chmod 600" in message
    assert "0644" in message and webhook.secret not in message

    run_dir = tmp_path / "run"
    assert send(make_alert(), cfg, run_dir) is False
    assert len(logged) == 1 and "chmod 600" in logged[0] and webhook.secret not in logged[0]
    assert webhook.requests == [] and len(queued(run_dir)) == 1

    url_file.chmod(0o600)
    assert alerts.resolve_url(cfg) == (webhook.url, "")
    assert flush_queue(run_dir, cfg) == (1, 0)
    assert len(webhook.wait_for(1)) == 1


def test_url_file_comments_and_blank_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("MY_HOOK", raising=False)
    url_file = tmp_path / "hook"
    url_file.write_text("# team channel\n\n  https://example.invalid/x  \n")
    url_file.chmod(0o600)
    assert alerts.resolve_url(section(url_env="MY_HOOK", url_file=str(url_file))) == ("https://example.invalid/x", "")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "No such file"),
        ("empty", "is empty"),
        ("not-a-url", "does not start with http"),
    ],
)
def test_url_file_problems(tmp_path, monkeypatch, setup, expected):
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    url_file = tmp_path / "hook"
    if setup != "missing":
        url_file.write_text("" if setup == "empty" else "hooks.example/secret-token\n")
        url_file.chmod(0o600)
    with pytest.raises(AlertConfigError, match=expected) as info:
        alerts.resolve_url(section(url_file=str(url_file)))
    assert "secret-token" not in str(info.value)


def test_no_url_disables_quietly(tmp_path, monkeypatch, capfd, logged):
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    url, reason = alerts.resolve_url(section())
    assert url is None and "RUNNER_WEBHOOK_URL" in reason
    assert alerts.resolve_url(section(enabled=False)) == (None, "alerts are disabled in the config")
    assert send(make_alert(), section(), tmp_path) is False
    assert flush_queue(tmp_path, section()) == (0, 0)
    assert capfd.readouterr() == ("", "") and logged == []
    assert not (tmp_path / "alerts").exists()


def test_env_var_wins_over_url_file(webhook, tmp_path, monkeypatch):
    monkeypatch.setenv("HOOK", webhook.url)
    assert alerts.resolve_url(section(url_env="HOOK", url_file=str(tmp_path / "absent"))) == (webhook.url, "")


def test_events_filter(webhook, cfg, tmp_path, capfd, logged):
    cfg["events"] = ["failed", "gave_up"]
    assert send(make_alert("completed"), cfg, tmp_path) is False
    assert send(make_alert("requeued"), cfg, tmp_path) is False
    assert send(make_alert("gave_up"), cfg, tmp_path) is True
    assert len(webhook.wait_for(1)) == 1 and len(webhook.requests) == 1
    assert not queued(tmp_path) and capfd.readouterr().err == "" and logged == []


def test_disabled_sends_nothing(webhook, cfg, tmp_path):
    assert send(make_alert(), {**cfg, "enabled": False}, tmp_path) is False
    assert webhook.requests == []


def test_secret_never_in_queue_files_or_logs(webhook, cfg, tmp_path, capfd, logged):
    leaky = [
        f"posting to {webhook.url}",
        f"requests.post('{webhook.url.split('://')[1]}') failed",
        "export SLACK=https://hooks.slack.com/services/T123/B456/abcdefSECRET",
        f"url: {webhook.path}",
    ]
    alert = make_alert(log_tail=leaky, cause=f"cause mentions {webhook.url}", extra={"hook": webhook.url})
    webhook.stop()
    assert send(alert, cfg, tmp_path) is False
    send(make_alert("gave_up"), cfg, tmp_path)
    err = capfd.readouterr().err + "\n".join(logged)
    stored = all_text(tmp_path)
    for text in (err, stored):
        assert webhook.secret not in text
        assert "abcdefSECRET" not in text and "hooks.slack.com" not in text
    assert "[webhook URL redacted]" in stored
    assert "posting to [webhook URL redacted]" in stored  # the rest of the line survives

    webhook.start()
    assert flush_queue(tmp_path, cfg) == (2, 0)
    delivered = json.dumps(webhook.wait_for(2))
    assert webhook.secret not in delivered and "abcdefSECRET" not in delivered
    assert webhook.secret not in capfd.readouterr().err + "\n".join(logged)


def test_delivered_payload_redacts_url_even_when_sent_directly(webhook, cfg, tmp_path):
    send(make_alert(log_tail=[f"GET {webhook.url} 500"]), cfg, tmp_path)
    [body] = webhook.wait_for(1)
    assert webhook.secret not in json.dumps(body)


def test_send_never_raises(cfg, tmp_path, logged):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg["retries"] = 0
    cfg["url_env"] = "NOPE_URL"
    os.environ["NOPE_URL"] = "http://127.0.0.1:9/hook/secret-token-xyz"  # discard port: refused
    try:
        assert send(make_alert(), cfg, blocker / "run") is False  # cannot even queue under a file
    finally:
        del os.environ["NOPE_URL"]
    assert len(logged) == 1 and "lost" in logged[0] and "secret-token-xyz" not in logged[0]


# ---------------------------------------------------------------------------------------- payloads


def test_slack_limits_and_escaping():
    long_lines = [f"{i:05d} " + "x" * 180 for i in range(200)] + ["<!channel> & ```fence```"]
    alert = make_alert(run="r" * 400, cause="c" * 5000, log_tail=long_lines, extra={"k": "v" * 5000})
    payload = alerts.slack_payload(alert)
    header, fields, extra, code, context = payload["blocks"]
    assert len(header["text"]["text"]) <= 150
    assert all(len(f["text"]) <= 2000 for f in fields["fields"])
    assert len(extra["text"]["text"]) <= 3000
    text = code["text"]["text"]
    assert len(text) <= 3000
    assert text.endswith("&lt;!channel&gt; &amp; '''fence'''\n```")  # newest line kept, no ping, fence intact
    assert text.count("```") == 2
    assert "00000 " not in text and "earlier cut" in text
    assert len(payload["text"]) <= 3000 and len(context["elements"][0]["text"]) <= 2000


def test_single_huge_log_line_is_cut_from_the_left():
    payload = alerts.slack_payload(make_alert(log_tail=["a" * 10_000 + "END"]))
    text = payload["blocks"][2]["text"]["text"]
    assert len(text) <= 3000 and text.endswith("END\n```")


def test_payload_without_optional_fields():
    alert = Alert(event="completed", run="r")
    payload = alerts.slack_payload(alert)
    assert [b["type"] for b in payload["blocks"]] == ["header", "section", "context"]
    assert all(f["text"].split("\n")[1] for f in payload["blocks"][1]["fields"])  # Slack refuses empty text
    assert "training finished" in payload["blocks"][-1]["elements"][0]["text"]
    assert alerts.json_payload(alert)["next_step"] == alerts.NEXT_STEPS["completed"]


def test_alert_validates_and_normalises(tmp_path):
    with pytest.raises(ValueError, match="unknown alert event"):
        Alert(event="exploded", run="r")
    # What callers pass from sacct and os.environ, not what the annotations say.
    raw: dict[str, Any] = {"run_dir": tmp_path, "job_id": 12, "exit_code": "3", "extra": {"n": 1}}
    a = Alert(event="failed", run="r", **raw)
    assert a.run_dir == str(tmp_path) and a.job_id == "12" and a.exit_code == 3 and a.extra == {"n": "1"}


# --------------------------------------------------------------------------------------- causes

TB = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "    main()"]


@pytest.mark.parametrize(
    ("lines", "exit_code", "state", "expected"),
    [
        (
            [*TB, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"],
            1,
            "FAILED",
            "OOM: torch.OutOfMemoryError",
        ),
        (["slurmstepd: error: Detected 1 oom-kill event(s) in StepId=5.0."], 137, "FAILED", "OOM: slurmstepd"),
        ([], 0, "OUT_OF_MEMORY", "OOM: Slurm state OUT_OF_MEMORY"),
        (
            ["[rank1]:[E ProcessGroupNCCL.cpp:563] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"],
            1,
            "FAILED",
            "NCCL timeout: [rank1]",
        ),
        (
            [*TB, "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"],
            1,
            None,
            "NCCL timeout",
        ),
        (["srun: error: gpu02: task 3: Killed"], None, "NODE_FAIL", "node failure: Slurm state NODE_FAIL"),
        (
            ["slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO NODE FAILURE ***"],
            None,
            None,
            "node failure",
        ),
        ([], None, "TIMEOUT", "time limit: Slurm state TIMEOUT"),
        (
            ["slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***"],
            15,
            None,
            "time limit: slurmstepd",
        ),
        ([], None, "PREEMPTED", "preemption: Slurm state PREEMPTED"),
        (["*** JOB 7 CANCELLED AT 2026-01-01T00:00:00 DUE TO PREEMPTION ***"], None, None, "preemption"),
        # A mere word is no evidence (it matched run-directory paths like ".../bench-preempt-x/..."):
        (["/runs/bench-preempt-x/checkpoints exists, writable"], None, "REQUEUED", "unknown"),
        (
            [*TB, "RuntimeError: shapes (3,) and (4,) differ"],
            1,
            "FAILED",
            "Python exception: RuntimeError: shapes (3,) and (4,) differ",
        ),
        (
            ["3: " + line for line in TB] + ["3: KeyError: 'lr'", "3: srun: error: task 3 exited"],
            1,
            "FAILED",
            "Python exception: KeyError: 'lr'",
        ),
        ([*TB, "KeyboardInterrupt"], 130, None, "Python exception: KeyboardInterrupt"),
        (["loading...", "ValueError: bad value"], 1, "FAILED", "Python exception: ValueError: bad value"),
        (["epoch 1 done", "ERROR: something odd"], 2, "FAILED", "unknown"),
        ([], None, None, "unknown"),
        # Root cause beats symptoms: one rank's OOM makes the others fail in NCCL ...
        (["Watchdog caught collective operation timeout", "CUDA out of memory"], 1, "FAILED", "OOM"),
        # ... and a dead node or a Slurm kill explains NCCL errors and tracebacks.
        ([*TB, "RuntimeError: NCCL error: remote process exited"], 1, "NODE_FAIL", "node failure"),
        ([*TB, "RuntimeError: x"], 0, "CANCELLED by 0", "Python exception: RuntimeError: x"),
        (["preemptible: false", "all good"], 1, "FAILED", "unknown"),
    ],
)
def test_guess_cause(lines, exit_code, state, expected):
    assert guess_cause(lines, exit_code, state).startswith(expected)


def test_guess_cause_uses_the_last_traceback():
    lines = [*TB, "ValueError: first", "", "During handling of the above exception, another exception occurred:", ""]
    lines += [*TB, "[rank0]: nonsense: line", "RuntimeError: second"]
    assert guess_cause(lines, 1, None) == "Python exception: RuntimeError: second"


# -------------------------------------------------------------------------------- alert_from_run


def write_log(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def rank_log(run: Path, rank: int, attempt: int = 1) -> Path:
    """Where the launcher writes a rank's log: one folder per attempt."""
    return RunDir(run).rank_log(rank, attempt)


def test_alert_from_run_picks_the_failing_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    run = tmp_path / "bert-base"
    write_log(rank_log(run, 0), [f"step {i}" for i in range(100)])
    write_log(rank_log(run, 1), [f"step {i}" for i in range(60)] + TB + ["ValueError: nan loss"])
    write_log(rank_log(run, 2), [f"step {i}" for i in range(100)])

    a = alert_from_run(run, "failed", exit_code=1, slurm_state="FAILED", attempt=3)
    assert (a.run, a.job_id, a.nodes, a.attempt, a.exit_code) == ("bert-base", "77", "n[1-2]", 3, 1)
    assert len(a.log_tail) == 30 and a.log_tail[-1] == "ValueError: nan loss"
    assert a.cause == "Python exception: ValueError: nan loss"
    assert a.extra == {"log": "logs/attempt-1/rank-00001.log"}
    assert a.next_step == alerts.NEXT_STEPS["failed"] and a.run_dir == str(run)


def test_alert_from_run_prefers_the_root_cause_rank(tmp_path):
    run = tmp_path / "r"
    write_log(rank_log(run, 0), [*TB, "RuntimeError: NCCL error: remote process exited"])
    write_log(rank_log(run, 3), [*TB, "torch.OutOfMemoryError: CUDA out of memory."])
    a = alert_from_run(run, "failed", exit_code=1)
    assert a.extra["log"] == "logs/attempt-1/rank-00003.log" and (a.cause or "").startswith("OOM")


def test_alert_from_run_defaults_to_rank_0_and_the_latest_attempt(tmp_path):
    run = tmp_path / "r"
    write_log(rank_log(run, 1, attempt=1), [*TB, "RuntimeError: old"])
    write_log(rank_log(run, 10, attempt=2), ["fine"])
    write_log(rank_log(run, 2, attempt=2), ["fine too"])
    future = time.time() + 3600
    os.utime(rank_log(run, 1, attempt=1), (future, future))  # the attempt number decides, not the mtime
    a = alert_from_run(run, "completed")
    assert a.extra["log"] == "logs/attempt-2/rank-00002.log" and a.log_tail == ["fine too"] and a.cause is None


def test_alert_from_run_cleans_progress_bars_and_big_logs(tmp_path):
    run = tmp_path / "r"
    big = ("filler " * 20 + "\n") * 5000
    bar = "\r".join(f"Epoch 0: {i}%|" for i in range(0, 101, 10))
    log = rank_log(run, 0)
    log.parent.mkdir(parents=True)
    log.write_text(big + bar + "\n\x1b[31mRuntimeError: red\x1b[0m\n")
    a = alert_from_run(run, "failed", job_id="1", nodes="n1")
    assert a.log_tail[-2:] == ["Epoch 0: 100%|", "RuntimeError: red"]
    assert a.cause == "Python exception: RuntimeError: red"


def test_alert_from_run_does_not_blame_an_earlier_attempt(tmp_path):
    run = tmp_path / "r"
    write_log(rank_log(run, 0, attempt=1), [*TB, "torch.OutOfMemoryError: CUDA out of memory."])
    write_log(rank_log(run, 0, attempt=2), [f"step {i}" for i in range(300)] + ["ValueError: new"])
    assert alert_from_run(run, "failed").cause == "Python exception: ValueError: new"


def test_alert_from_run_without_logs(tmp_path):
    a = alert_from_run(tmp_path, "timeout", slurm_state="TIMEOUT", job_id="5", nodes="")
    assert a.log_tail == [] and a.cause == "time limit: Slurm state TIMEOUT" and a.extra == {}
    (tmp_path / "logs" / "attempt-1").mkdir(parents=True)  # an attempt that died before any rank wrote
    assert alert_from_run(tmp_path, "failed", job_id="5", nodes="").extra == {}
    with pytest.raises(TypeError, match="bogus"):
        alert_from_run(tmp_path, "failed", bogus=1)


def test_alert_from_run_end_to_end(webhook, cfg, tmp_path):
    run = tmp_path / "r"
    write_log(rank_log(run, 0), [*TB, "RuntimeError: end to end"])
    assert send(alert_from_run(run, "failed", job_id="9", nodes="n1", exit_code=1), cfg, run)
    [body] = webhook.wait_for(1)
    assert "RuntimeError: end to end" in body["blocks"][-2]["text"]["text"]
    assert "*log*: logs/attempt-1/rank-00000.log" in body["blocks"][2]["text"]["text"]


# ------------------------------------------------------------------------------------------ config
# The alerts: section is validated by runner.spec with the rest of the config; alerts get it with every key.


def write_config(tmp_path: Path, alerts_block: Any) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["alerts"] = alerts_block
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_defaults_and_events(tmp_path):
    assert EVENTS == (
        "failed",
        "preempted",
        "requeued",
        "timeout",
        "resubmitted",
        "gave_up",
        "completed",
        "cancelled",
        "preflight_failed",
        "hang",
        "nan",
        "straggler",
    )
    defaults = {
        "enabled": True,
        "kind": "slack",
        "url_env": "RUNNER_WEBHOOK_URL",
        "url_file": None,
        "events": list(EVENTS),
        "timeout_s": 5.0,
        "retries": 3,
        "backoff_s": 1.0,
    }
    assert defaults == section()
    assert set(alerts.NEXT_STEPS) == set(EVENTS)
    assert spec.load(write_config(tmp_path, defaults)).data["alerts"] == defaults  # the defaults are valid
    assert spec.load(write_config(tmp_path, None)).data["alerts"] == defaults  # YAML `alerts:` with nothing under it


BAD_ALERTS = [
    ({"kind": "teams"}, "alerts.kind: found 'teams'; expected one of slack, json"),
    ({"events": ["failed", "exploded"]}, "alerts.events[1]: found 'exploded'"),
    ({"events": None}, "alerts.events: found None; expected a list"),
    ({"retries": -1}, "alerts.retries: found -1; expected a value >= 0"),
    ({"retries": True}, "alerts.retries: found True; expected an integer"),
    ({"timeout_s": 0}, "alerts.timeout_s: found 0; expected a value >= 0.1"),
    ({"backoff_s": -1}, "alerts.backoff_s: found -1"),
    ({"url": "x"}, "alerts.url: found 'url'; expected a known key"),
    ({"enabled": "yes"}, "alerts.enabled: found 'yes'; expected true/false"),
    ({"url_env": ""}, "alerts.url_env: found ''"),
    ({"url_file": 3}, "alerts.url_file: found 3; expected a string or null"),
]


@pytest.mark.parametrize(("block", "expected"), BAD_ALERTS)
def test_a_bad_alerts_section_is_rejected_by_validation(tmp_path, block, expected):
    with pytest.raises(ConfigError) as err:
        spec.load(write_config(tmp_path, block))
    assert len(err.value.problems) == 1 and expected in err.value.problems[0], err.value.problems


def test_validation_reports_every_problem_of_the_alerts_section(tmp_path):
    block = {"kind": "teams", "retries": -1, "timeout_s": 0, "url": "x", "enabled": "yes"}
    with pytest.raises(ConfigError) as err:
        spec.load(write_config(tmp_path, block))
    problems = err.value.problems
    assert len(problems) == 5
    assert any("alerts.url: found 'url'; expected a known key" in p for p in problems)
    assert any("alerts.kind: found 'teams'; expected one of slack, json" in p for p in problems)


# ------------------------------------------------------------------------------- alerts that cannot vanish


def test_every_alert_event_and_cause_kind_has_a_title_an_emoji_and_a_next_step() -> None:
    """A table over the Literals: an event or cause kind added without its words fails here, not in a job."""
    import typing

    from runner import ledger
    from runner.alerts import payload

    events = set(typing.get_args(ledger.AlertEvent))
    assert events == set(EVENTS)
    for table in (payload._TITLES, payload._EMOJI, nextstep.NEXT_STEPS):
        assert set(table) == events and all(table.values())
    kinds = set(typing.get_args(ledger.CauseKind))
    for table in (payload.CAUSE_TITLES, payload.CAUSE_EMOJI, nextstep.CAUSE_STEPS):
        assert set(table) == kinds and all(table.values())
    for event in events:  # every event renders, with a Next: line of its own
        for kind in ("slack", "json"):
            body = payload.render_payload(make_alert(event, next_step=""), kind)
            assert nextstep.NEXT_STEPS[event] in json.dumps(body)


@pytest.mark.parametrize("kind", ["slack", "json"])
def test_an_alert_whose_payload_cannot_be_built_still_goes_out_plain_and_the_error_is_logged(
        webhook, cfg, tmp_path, logged, monkeypatch, kind):  # type: ignore[no-untyped-def]
    from runner.alerts import payload

    def broken(alert: Alert, *, secrets: object = ()) -> dict[str, Any]:
        raise KeyError("no-such-title")

    monkeypatch.setattr(payload, "slack_payload", broken)
    monkeypatch.setattr(payload, "json_payload", broken)
    cfg["kind"] = kind
    assert send(make_alert(cause="OOM: CUDA out of memory"), cfg, tmp_path) is True
    body = webhook.wait_for(1)[0]
    assert "llama-7b failed (job 4242, attempt 2): OOM: CUDA out of memory" in body["text"]
    assert "could not build the full alert: KeyError" in body["text"]
    assert any("could not be built (KeyError" in line for line in logged)
    assert alerts.enqueue(tmp_path, cfg, [make_alert("hang")]) == 1  # queued plain as well, never dropped


def test_a_cause_is_data_and_its_sentence_is_rendered_from_it() -> None:
    from runner.alerts import causes

    oom = causes.find_cause(["RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"], 1, None)
    assert oom.kind == "oom" and str(oom) == "OOM: RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
    assert causes.find_cause([], None, "NODE_FAIL").kind == "node_failure"
    crash = {"type": "RuntimeError", "message": "boom", "frame": "train.py:3 in step", "step": 7}
    assert str(causes.crashed(crash)) == "Python exception: RuntimeError: boom at train.py:3 in step, step 7"
    assert str(causes.crashed(crash, "crash_loop")) == \
        "crash_loop: RuntimeError: boom at train.py:3 in step, step 7, in two attempts in a row"
    assert str(causes.Cause("bad_nodes", "eth9 not found", node="n1, n2")) == \
        "node: n1, n2 failed the preflight: eth9 not found"
    assert str(causes.Cause("nan", "loss", step=12)) == \
        "nan: non-finite loss at step 12; training stopped before any checkpoint of it"
    assert str(causes.Cause("rank", "killed by SIGKILL", rank=3, node="n2")) == "rank 3 on n2: killed by SIGKILL"
    body = alerts.slack_payload(make_alert(cause=str(oom), cause_kind=oom.kind))
    assert ":boom: OOM: RuntimeError" in json.dumps(body)
    plain = alerts.json_payload(make_alert(cause=str(oom), cause_kind=oom.kind))
    assert plain["cause"] == str(oom) and plain["cause_kind"] == "oom" and plain["cause_title"] == "out of memory"
