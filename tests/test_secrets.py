"""The webhook URL never touches disk: not the ledger, exit status, alert queue, manifest or `runner status --json`;
not whole, not its token, not URL-encoded. The git diff stays out of the manifest. A url_file is the user's own.

Real parts: the exit hook runs as the batch script runs it (``python -m runner.host.jobhook exit``), its alert
goes to the real webhook server, `runner status` and `runner submit` run as commands.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest
import yaml

from runner import alerts, spec
from runner.alerts import AlertConfigError
from runner.host import submit
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


@pytest.mark.local
def test_exit_hook_writes_no_secret_and_says_what_cron_will_do(webhook: WebhookServer, tmp_path: Path) -> None:
    run = make_run(tmp_path, webhook.url)
    (tmp_path / "slurm.conf").write_text("")  # no cluster here: Slurm's commands fail at once (a missing file: 60 s)
    env = {**os.environ, "RUNNER_WEBHOOK_URL": webhook.url, "SLURM_JOB_ID": "4242",
           "SLURM_CONF": str(tmp_path / "slurm.conf")}
    out = subprocess.run([sys.executable, "-m", "runner.host.jobhook", "exit", "--rc", "1", str(run)], env=env,
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    [sent] = webhook.wait_for(1, timeout=20)
    assert sent["event"] == "failed" and "RuntimeError" in sent["cause"]
    assert "runner cron resubmits it" in sent["next_step"] and "Not retried" not in sent["next_step"]
    assert found_in(json.dumps(sent), webhook.url) == []
    exit_event = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()][-1]
    assert exit_event["event"] == "exit" and "[webhook URL redacted]" in exit_event["cause"]
    # An older runner left the URL in the ledger: `runner status --json` still does not show it.
    with open(run / "ledger.jsonl", "a") as f:
        f.write(json.dumps({"time": 3.0, "event": "exit", "outcome": "failed", "cause": f"x {webhook.url}"}) + "\n")
    status = subprocess.run([sys.executable, "-m", "runner", "status", str(run), "--json"], env=env,
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert status.returncode == 0, status.stderr
    assert found_in(status.stdout, webhook.url) == [] and "redacted" in status.stdout
    (run / "ledger.jsonl").write_text("")  # the line written above by hand; what runner wrote is checked below
    (run / "logs" / "attempt-1" / "rank-00000.log").unlink()  # the user's own log: not runner's to rewrite
    for path in run.rglob("*"):
        if path.is_file():
            assert found_in(path.read_text(errors="replace"), webhook.url) == [], path


def test_queued_alerts_hold_no_secret(webhook: WebhookServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    run = make_run(tmp_path, webhook.url)
    section = dict(spec.load(CONF, ["alerts.kind=slack"]).data["alerts"])
    alert = alerts.alert_from_run(run, "failed", exit_code=1)
    assert alerts.enqueue(run, section, [alert]) == 1
    [entry] = alerts.queue_dir(run).glob("*.json")
    assert found_in(entry.read_text(), webhook.url) == []


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30)


@pytest.mark.local
def test_manifest_keeps_the_diff_out(webhook: WebhookServer, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A dirty checkout with a token in `.env`: the manifest names the file and the diff's hash; the diff is in a
    0600 file, the webhook URL redacted there too; --dry-run prints neither."""
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", webhook.url)
    repo = tmp_path / "project"
    repo.mkdir()
    conf = repo / "train.yaml"
    conf.write_text((REPO / "conf" / "quickstart.yaml").read_text())
    (repo / ".env").write_text("A=1\n")
    git(repo, "init", "-q")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "x", "--allow-empty")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "files")
    (repo / ".env").write_text(f"A=1\nAPI_TOKEN=tok_live_abcdef123456\nRUNNER_WEBHOOK_URL={webhook.url}\n")
    overrides = [f"run_root={tmp_path / 'runs'}"]
    dry = subprocess.run([sys.executable, "-m", "runner", "submit", str(conf), *overrides, "--dry-run"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "RUNNER_WEBHOOK_URL": webhook.url})
    assert dry.returncode == 0, dry.stderr
    assert "tok_live_abcdef123456" not in dry.stdout and found_in(dry.stdout, webhook.url) == []
    assert "git.diff (mode 0600" in dry.stdout
    plan = submit.plan(conf, overrides)
    submit.write(plan)
    manifest = json.loads(plan.run.manifest.read_text())
    assert manifest["git"]["dirty"] is True and manifest["git"]["diff_files"] == [".env"]
    assert len(manifest["git"]["diff_sha256"]) == 64 and "diff" not in manifest["git"]
    text = plan.run.manifest.read_text()
    assert "tok_live_abcdef123456" not in text and found_in(text, webhook.url) == []
    diff = plan.run.root / "git.diff"
    assert stat.S_IMODE(diff.stat().st_mode) == 0o600
    assert "tok_live_abcdef123456" in diff.read_text() and found_in(diff.read_text(), webhook.url) == []


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


ENV_PROBE = """import os, sys
open(sys.argv[1], "w").write(os.environ.get("MY_HOOK", "<unset>"))
"""


@pytest.mark.local
def test_a_local_run_gets_an_env_secret_that_no_file_of_the_run_holds(webhook: WebhookServer, tmp_path: Path) -> None:
    """An env: value holding the webhook URL is kept out of config.yaml and job.sbatch (in secret.env, 0600); the
    local launcher gives the ranks the real value, as the batch script's `source` does on Slurm."""
    (tmp_path / "probe.py").write_text(ENV_PROBE)
    conf = tmp_path / "probe.yaml"
    conf.write_text(yaml.safe_dump({
        "num_nodes": 1, "num_device": 1, "command": f"python probe.py {tmp_path / 'seen.txt'}",
        "runner": {"name": "probe", "scheduler": "local", "run_root": str(tmp_path / "runs"),
                   "container": {"runtime": "none"}, "env": {"MY_HOOK": webhook.url}}}))
    env = {**os.environ, "RUNNER_WEBHOOK_URL": webhook.url, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(conf)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "seen.txt").read_text() == webhook.url
    [run] = (tmp_path / "runs").iterdir()
    assert stat.S_IMODE((run / "secret.env").stat().st_mode) == 0o600
    for name in ("config.yaml", "job.sbatch", "manifest.json", "ledger.jsonl"):
        assert found_in((run / name).read_text(), webhook.url) == [], name


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
    step = next(line for line in script.splitlines() if " srun --kill-on-bad-exit=1 " in line)
    assert step.startswith("env -u MY_SLACK -u RUNNER_WEBHOOK_URL srun "), step
    assert "hook exit --rc" in script  # the exit hook (a trap) runs in the batch shell, which keeps the variables
    assert "unset" not in script and "MY_SLACK=" not in script


ENV_DUMP = """import os, sys
print(dict(os.environ))
print(open("/proc/self/environ", "rb").read().replace(b"\\0", b"\\n").decode())
"""


@pytest.mark.local
@pytest.mark.parametrize("command", ["python dump.py", "bash -c 'env; python dump.py'"])
def test_a_program_printing_its_environment_writes_no_webhook_url(tmp_path: Path, command: str) -> None:
    """The submitting shell holds the webhook URL (the default variable and a config's own url_env); the program,
    in process or as a child, prints its whole environment: the URL is in no file under the run root and not in
    what `runner submit` printed."""
    (tmp_path / "dump.py").write_text(ENV_DUMP)
    url = "https://hooks.slack.com/services/T0000/B0000/s3cr3tt0k3nvalue"
    conf = tmp_path / "dump.yaml"
    conf.write_text(yaml.safe_dump({
        "num_nodes": 1, "num_device": 2, "command": command,
        "runner": {"name": "dump", "scheduler": "local", "run_root": str(tmp_path / "runs"),
                   "container": {"runtime": "none"}, "alerts": {"url_env": "TEAM_HOOK", "enabled": False}}}))
    env = {**os.environ, "RUNNER_WEBHOOK_URL": url, "TEAM_HOOK": url, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(conf)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = (tmp_path / "runs").iterdir()
    logs = sorted((run / "logs").rglob("rank-*.log"))
    assert len(logs) == 2 and all("'MASTER_PORT'" in f.read_text() for f in logs)  # the dump ran, in every rank
    for f in [p for p in run.rglob("*") if p.is_file()]:
        assert found_in(f.read_text(errors="replace"), url) == [], f
    assert found_in(out.stdout + out.stderr, url) == []
