"""The webhook URL never touches disk: not the ledger, exit status, alert queue, manifest or `runner status --json`;
not whole, not its token, not URL-encoded. The git diff stays out of the manifest. A url_file is the user's own.

Real parts (tests/test_secrets_local.py): the exit hook runs as the batch script runs it (``python -m
runner.host.jobhook exit``), its alert goes to the real webhook server, `runner status` and `runner submit` run as
commands.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest
import yaml

from runner import alerts, redaction, spec
from runner.alerts import AlertConfigError
from tests.ci import need

pytestmark = pytest.mark.unit

if TYPE_CHECKING:
    from tests.webhook_server import WebhookServer

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "slurm-2node.yaml"


def leaks(url: str) -> list[str]:
    """Every form of the URL that must not appear: whole, without scheme, its token, each URL-encoded."""
    token = url.rstrip("/").rsplit("/", 1)[-1]
    forms = [url, url.split("://", 1)[1], token]
    return forms + [quote(f, safe="") for f in forms]


def found_in(text: str, url: str) -> list[str]:
    return [f for f in leaks(url) if f in text]


def test_redact_covers_every_form() -> None:
    url = "https://hooks.example.com/services/T000/B000/a1b2c3d4e5f6a7b8"
    text = (f"POST {url} failed; retry {quote(url, safe='')}; host hooks.example.com path "
            f"/services/T000/B000/a1b2c3d4e5f6a7b8 token=a1b2c3d4e5f6a7b8 ?u={quote(url)}")
    out = alerts.redact(text, [url])
    assert found_in(out, url) == [], out
    query = "https://example.com/hook?token=s3cr3tT0kenValue&x=1"
    assert "s3cr3tT0kenValue" not in alerts.redact(f"sent with token s3cr3tT0kenValue to {query}", [query])
    slack = "https://hooks.slack.com/services/T1/B2/zzzzzzzzzzzzzzzz"  # found by its shape, no secret given
    assert "zzzzzzzz" not in alerts.redact(f"url={quote(slack, safe='')} and {slack}")


def make_run(root: Path, url: str) -> Path:
    """A Slurm run directory whose job 4242 has failed, its rank log quoting the webhook URL in three forms."""
    run = root / "leaky-run"
    cfg = spec.load(CONF, [f"run_root={root}", "alerts.kind=json", "alerts.backoff_s=0.05", "alerts.retries=1",
                           "container.runtime=none"])
    (run / "logs" / "attempt-1").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.data, sort_keys=False))
    (run / "manifest.json").write_text(json.dumps({"scheduler": "slurm", "config_hash": cfg.hash(), "created": 0}))
    (run / "job_id").write_text("4242\n")
    ledger = [{"time": 1.0, "event": "submitted", "job_id": "4242"}, {"time": 2.0, "event": "start", "job_id": "4242"}]
    (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
    (run / "logs" / "attempt-1" / "rank-00000.log").write_text(
        f"step 10 posting metrics to {url}\nproxy saw {quote(url, safe='')}\n"
        "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
        f"RuntimeError: webhook {url} refused token {url.rsplit('/', 1)[-1]}\n")
    return run


def test_queued_alerts_hold_no_secret(webhook: WebhookServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    run = make_run(tmp_path, webhook.url)
    section = dict(spec.load(CONF, ["alerts.kind=slack"]).data["alerts"])
    alert = alerts.alert_from_run(run, "failed", exit_code=1)
    assert alerts.enqueue(run, section, [alert]) == 1
    [entry] = alerts.queue_dir(run).glob("*.json")
    assert found_in(entry.read_text(), webhook.url) == []


def private_file(tmp_path: Path, url: str) -> tuple[Path, Path]:
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    path = folder / "hook.url"
    path.write_text(url + "\n")
    path.chmod(0o600)
    return folder, path


def _other_owner(folder: Path, path: Path) -> None:
    need(os.geteuid() == 0, "chown to another user needs root")
    os.chown(path, 65534, 65534)


URL_FILES: list[Any] = [
    pytest.param(_other_owner, "owned by uid 65534; expected your own", id="owned by another user"),
    pytest.param(lambda folder, path: path.chmod(0o640), "found mode 0640; expected 0600", id="group may read"),
    pytest.param(lambda folder, path: path.chmod(0o604), "found mode 0604; expected 0600", id="others may read"),
    pytest.param(lambda folder, path: folder.chmod(0o777), "writable by others", id="in a world-writable directory"),
    pytest.param(lambda folder, path: folder.chmod(0o770), "writable by others", id="in a group-writable directory"),
]


@pytest.mark.parametrize("spoil, message", URL_FILES)
def test_url_file_must_be_the_users_alone(spoil: Any, message: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNNER_WEBHOOK_URL", raising=False)
    url = "https://hooks.example.com/services/T/B/filetoken1234567"
    folder, path = private_file(tmp_path, url)
    section = {**spec.load(CONF).data["alerts"], "url_file": str(path)}
    assert alerts.resolve_url(section) == (url, "")  # the user's own 0600 file in a private folder
    spoil(folder, path)
    with pytest.raises(AlertConfigError, match=message) as info:
        alerts.resolve_url(section)
    assert "\n" not in str(info.value) and "filetoken" not in str(info.value) and "hint:" in str(info.value)


@pytest.mark.parametrize("alerts_url_env, env, dropped", [
    (None, {}, ["RUNNER_WEBHOOK_URL"]),
    ("MY_SLACK", {}, ["MY_SLACK", "RUNNER_WEBHOOK_URL"]),
    ("RUNNER_WEBHOOK_URL", {"OTHER": "x"}, ["RUNNER_WEBHOOK_URL"]),
    # named in env: the run asked for it in its ranks (its value then travels in secret.env, not in readable files)
    ("MY_SLACK", {"MY_SLACK": "https://hooks.slack.com/services/T/B/abcdefgh"}, ["RUNNER_WEBHOOK_URL"]),
    (None, {"RUNNER_WEBHOOK_URL": "https://example.com/hook/abcdefgh"}, []),
    ("", {}, ["RUNNER_WEBHOOK_URL"]),  # not a name: never crashes, the default stays out
])
def test_the_webhook_variables_no_rank_inherits(alerts_url_env: str | None, env: dict[str, str],
                                                dropped: list[str]) -> None:
    from runner import redaction

    cfg: dict[str, Any] = {"env": env, "alerts": {} if alerts_url_env is None else {"url_env": alerts_url_env}}
    assert redaction.webhook_names(cfg) == dropped


def test_the_batch_script_starts_the_ranks_without_the_webhook_variables() -> None:
    """The exit hook (host side) keeps the URL it alerts with; srun, and so every rank, container and program, gets
    an environment without it."""
    from runner.host import render

    cfg = spec.load(CONF, ["alerts.url_env=MY_SLACK"], run_dir="/shared/runs/x")
    script = render.sbatch(cfg, Path("/shared/runs/x"), "/shared/x.sif")
    step = next(line.strip() for line in script.splitlines() if " srun --kill-on-bad-exit=1 " in line)
    assert step.startswith("env -u MY_SLACK -u RUNNER_WEBHOOK_URL srun "), step
    assert "hook exit --rc" in script  # the exit hook (a trap) runs in the batch shell, which keeps the variables
    assert "unset" not in script and "MY_SLACK=" not in script


SCRUB_URL = "https://alerts.example.com/hooks/T0000/s3cr3tt0k3nvalue42"


@pytest.mark.parametrize(("pieces", "hold", "expected"), [
    # A secret split across writes (a flush between): found whole all the same, the text around it kept as is.
    (["a https://alerts.exa", "mple.com/hooks/T0000/s3cr3t", "t0k3nvalue42 b\n"], True,
     "a [webhook URL redacted] b\n"),
    (["token=s3cr3tt0k", "3nvalue42&x=1\n", "host alerts.example.com/hooks/T0000/s3cr3tt0k3nvalue42"], True,
     "token=[webhook URL redacted]&x=1\nhost [webhook URL redacted]"),
    # A Slack URL, known to nobody, by its shape; its end is where the text after it begins.
    (["x hooks.slack.com/services/", "T1/B2/zzzzzzzzzzzz", "zzzz\ty"], True, "x [webhook URL redacted]\ty"),
    # A rank's stream (no hold): what a flush leaves is passed on, the text unchanged where there is no secret.
    (["progress 10%\r", "progress 20%"], False, "progress 10%\rprogress 20%"),
    (["", "\n\n", "no secret here"], False, "\n\nno secret here"),
])
def test_a_scrubbed_stream_passes_on_text_without_the_secrets_this_process_knows(
        monkeypatch: pytest.MonkeyPatch, pieces: list[str], hold: bool, expected: str) -> None:
    monkeypatch.setattr(redaction, "_KNOWN", set())
    monkeypatch.setattr(redaction, "_VARIANTS", [])
    redaction.remember([SCRUB_URL])
    out = io.StringIO()
    stream = redaction.Scrubbed(out, hold=hold)
    for piece in pieces:
        assert stream.write(piece) == len(piece)
        stream.flush()
        assert found_in(out.getvalue(), SCRUB_URL) == []
    stream.close()
    assert out.getvalue() == expected


def test_a_scrubbed_stream_holds_at_most_keep_characters_and_is_the_stream_it_wraps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redaction, "_VARIANTS", [])
    out = io.StringIO()
    stream = redaction.Scrubbed(out, hold=True)
    stream.write("x" * (redaction.Scrubbed.KEEP + 100))
    stream.flush()
    assert out.getvalue() == "x" * 100  # a line without whitespace is not held whole
    stream.close()
    assert out.getvalue() == "x" * (redaction.Scrubbed.KEEP + 100)
    assert stream.getvalue() == out.getvalue() and stream.closed is False  # the rest is the wrapped stream's
