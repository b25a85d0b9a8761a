"""The webhook URL never touches disk, in real runs and hooks (the local tier; the rest: tests/test_secrets.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from runner.host import submit
from runner.rundir import RunDir
from tests.test_secrets import REPO, found_in, make_run

if TYPE_CHECKING:
    from tests.webhook_server import WebhookServer

pytestmark = pytest.mark.local


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


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30)


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


ENV_PROBE = """import os, sys
open(sys.argv[1], "w").write(os.environ.get("MY_HOOK", "<unset>"))
"""


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


ENV_DUMP = """import os, sys
print(dict(os.environ))
print(open("/proc/self/environ", "rb").read().replace(b"\\0", b"\\n").decode())
"""


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


LEAKER = """import os, sys
print(dict(os.environ))
print(open("/proc/self/environ", "rb").read().replace(b"\\0", b"\\n").decode())
source = sys.argv[1]
url = os.environ["MY_HOOK"] if source == "env" else open(sys.argv[2]).read().strip() if source == "file" else {url!r}
print("posting to", url, flush=True)
raise RuntimeError(f"POST {{url}} failed: 403 Forbidden")
"""
URL = "https://alerts.example.com/hooks/T0000/s3cr3tt0k3nvalue42"  # no Slack shape: found only as a known secret


def leaking_run(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess[str], Path, dict[str, str]]:
    """`runner submit` of a 2-rank program that prints its whole environment, then the webhook URL it got (from
    ``env:``, from the file ``alerts.url_file`` names, or written in its own source), and raises an exception that
    quotes it; the submitting shell holds the URL in the default variable and in ``alerts.url_env``'s."""
    (tmp_path / "leak.py").write_text(LEAKER.format(url=URL if source == "source" else "unused"))
    hook_file = tmp_path / "hook.url"
    hook_file.write_text(URL + "\n")
    hook_file.chmod(0o600)
    runner_block: dict[str, object] = {
        "name": "leak", "scheduler": "local", "run_root": str(tmp_path / "runs"), "container": {"runtime": "none"},
        "alerts": {"url_env": "TEAM_HOOK", "enabled": False}}
    if source == "env":
        runner_block["env"] = {"MY_HOOK": URL}
    if source == "file":
        runner_block["alerts"] = {"url_file": str(hook_file), "enabled": False}
    conf = tmp_path / "leak.yaml"
    conf.write_text(yaml.safe_dump({"num_nodes": 1, "num_device": 2, "runner": runner_block,
                                    "command": f"python leak.py {source} {hook_file}"}))
    env = {**os.environ, "RUNNER_WEBHOOK_URL": URL, "TEAM_HOOK": URL, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(conf)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr  # the program's exception: a failed run
    [run] = (tmp_path / "runs").iterdir()
    return out, run, env


def shown(run: Path, env: dict[str, str]) -> str:
    """What `runner logs` (each rank) and `runner status` print of the run."""
    outs = [subprocess.run([sys.executable, "-m", "runner", *args], env=env, capture_output=True, text=True,
                           timeout=120, cwd=REPO) for args in (["logs", str(run), "--rank", "0"],
                                                              ["logs", str(run), "--rank", "1"],
                                                              ["status", str(run), "--json"])]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    return "".join(o.stdout + o.stderr for o in outs)


@pytest.mark.parametrize("source", ["env", "file"])
def test_a_secret_the_ranks_know_reaches_no_file_of_the_run_and_no_output(tmp_path: Path, source: str) -> None:
    """The program got the webhook URL as the config said (an ``env:`` variable; the file ``alerts.url_file``
    names), printed its environment and raised quoting it: the ranks know that secret too, and what Python prints
    in a rank passes runner's scrubbing on its way to the rank log. No file under the run root holds it (but
    ``secret.env``, mode 0600, where ``env:`` put it as asked), nor any command's output."""
    out, run, env = leaking_run(tmp_path, source)
    logs = sorted((run / "logs").rglob("rank-*.log"))
    assert len(logs) == 2 and all("RuntimeError: POST [webhook URL redacted] failed" in f.read_text() for f in logs)
    assert all("'MASTER_PORT'" in f.read_text() for f in logs)  # the environment was printed, in every rank
    files = [p for p in run.rglob("*") if p.is_file() and p != run / "secret.env"]
    assert [str(f) for f in files if found_in(f.read_text(errors="replace"), URL)] == []
    assert found_in(out.stdout + out.stderr, URL) == [] and "[webhook URL redacted]" in out.stdout  # the tail
    assert found_in(shown(run, env), URL) == []


def test_a_secret_only_the_program_had_is_shown_by_no_command(tmp_path: Path) -> None:
    """The URL written in the program's own source: the ranks cannot know it is a secret (runner gives them no
    webhook variable), so the rank log holds what the program printed. The host that reads it back knows the URL
    (its variables): the console tail of the local run and `runner logs` show it redacted."""
    out, run, env = leaking_run(tmp_path, "source")
    assert found_in(RunDir(run).rank_log(0, 1).read_text(), URL) != []  # the program's own output, as written
    assert found_in(out.stdout + out.stderr, URL) == [] and "[webhook URL redacted]" in out.stdout
    printed = shown(run, env)
    assert found_in(printed, URL) == [] and "posting to [webhook URL redacted]" in printed
