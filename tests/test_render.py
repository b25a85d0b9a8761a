"""Rendered artifacts: golden files, real linters, and hostile values that must stay literal."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner import spec
from runner.errors import ConfigError
from runner.host import render
from runner.rundir import EXIT_SUPERSEDED, RunDir

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
VENV_BIN = Path(sys.executable).parent
RUN_DIR = Path("/shared/runs/quickstart-20260101-000000")
GOLDEN_CONF = REPO / "conf" / "ngc-4x8gpu.yaml"


def artifacts(overrides: list[str] | None = None, path: Path = GOLDEN_CONF) -> dict[str, str]:
    cfg = spec.load(path, overrides or [], run_dir=str(RUN_DIR))
    sbatch = render.sbatch(cfg, RUN_DIR, "/shared/images/ngc-4x8gpu-GOLDEN.sif")
    return {
        "Dockerfile": render.dockerfile(cfg, "GOLDEN"),
        "apptainer.def": render.apptainer_def(cfg, "GOLDEN", "docker-archive", "ngc-4x8gpu-GOLDEN.tar"),
        # The host python differs per machine; the golden file names it PYTHON.
        "job.sbatch": sbatch.replace(render.q(sys.executable), "PYTHON"),
    }


@pytest.mark.parametrize("name", ["Dockerfile", "apptainer.def", "job.sbatch"])
def test_golden(name: str, request: pytest.FixtureRequest) -> None:
    text = artifacts()[name]
    path = GOLDEN / name
    if request.config.getoption("--update-golden"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "rendered"))
        pytest.fail(f"{name} differs from its golden file (run pytest --update-golden if intended):\n{diff}")


def lint(tool: str, *args: str, text: str, tmp_path: Path, name: str) -> None:
    exe = shutil.which(tool, path=str(VENV_BIN)) or shutil.which(tool)
    assert exe, f"{tool} is a dev dependency (pip install -e .[dev])"
    path = tmp_path / name
    path.write_text(text)
    out = subprocess.run([exe, *args, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{tool} on {name}:\n{out.stdout}{out.stderr}\n--- {name} ---\n{text}"


CONFIGS = [
    (GOLDEN_CONF, []),
    (REPO / "conf" / "quickstart.yaml", []),
    (GOLDEN_CONF, ["container.runtime=singularity", "container.apt=[]", "container.pip=[]",
                   "container.nccl_tests=true", "container.perftest=true", "slurm.requeue=false"]),
    (GOLDEN_CONF, ["container.install_lightning=false", "env={}", "slurm.partition=null"]),
    (GOLDEN_CONF, ["resume.successor=true"]),
]


@pytest.mark.local
@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_shellcheck_on_sbatch(path: Path, overrides: list[str], tmp_path: Path) -> None:
    lint("shellcheck", "-s", "bash", text=artifacts(overrides, path)["job.sbatch"], tmp_path=tmp_path,
         name="job.sbatch")


@pytest.mark.local
@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_hadolint_on_dockerfile(path: Path, overrides: list[str], tmp_path: Path) -> None:
    # -c explicitly: hadolint would otherwise pick up a .hadolint.yaml from the working directory.
    cfg = tmp_path / "hadolint.yaml"
    cfg.write_text("failure-threshold: warning\n")
    lint("hadolint", "-c", str(cfg), text=artifacts(overrides, path)["Dockerfile"], tmp_path=tmp_path,
         name="Dockerfile")


@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_apptainer_def_has_no_build_arg_braces(path: Path, overrides: list[str]) -> None:
    text = artifacts(overrides, path)["apptainer.def"]
    assert "{{" not in text and "}}" not in text  # Apptainer >= 1.2 treats them as build arguments
    assert text.startswith("Bootstrap: docker-archive\nFrom: ngc-4x8gpu-GOLDEN.tar\n")
    labels = text.split("%labels\n")[1].split("\n\n")[0].splitlines()
    assert all(len(line.split(None, 1)) == 2 for line in labels)  # KEY VALUE


def test_sbatch_layout_follows_config() -> None:
    text = artifacts()["job.sbatch"]
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR2@180", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={RUN_DIR}/logs/slurm-%j.out", "#SBATCH --partition=gpu"):
        assert line in text.splitlines()
    srun = next(line for line in text.splitlines() if line.startswith("env -u RUNNER_WEBHOOK_URL srun "))
    assert "apptainer exec --nv --bind" in srun and "/shared/images/ngc-4x8gpu-GOLDEN.sif" in srun
    assert '--env "MASTER_ADDR=$MASTER_ADDR"' in srun


def test_runtimes_differ_only_in_exec_prefix() -> None:
    a = artifacts(["container.runtime=apptainer"])["job.sbatch"].splitlines()
    b = artifacts(["container.runtime=none"])["job.sbatch"].splitlines()
    changed = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert len(changed) == 1 and all(x.startswith("env -u RUNNER_WEBHOOK_URL srun ") for x in changed[0])
    assert changed[0][1].split(" -m runner.job.launch")[1] == changed[0][0].split(" -m runner.job.launch")[1]


# Hostile values: quotes, newlines, $(...), backticks, globs. Each must arrive in the job's environment
# byte for byte, and none may run.
HOSTILE = st.text(alphabet=st.sampled_from(list("ab $()`'\"\\;&|<>*?!{}[]#~\n\t=%")), min_size=0, max_size=40)


@pytest.mark.local
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(HOSTILE, min_size=1, max_size=4))
def test_hostile_env_values_stay_literal(values: list[str], tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    values = [*values, f"$(touch {canary})", f"`touch {canary}`"]
    env = {f"V{i}": v for i, v in enumerate(values)}
    overrides = ["env={}"]
    cfg = spec.load(GOLDEN_CONF, overrides, run_dir=str(RUN_DIR))
    cfg.data["env"] = env
    script = render.sbatch(cfg, RUN_DIR, "/img.sif")
    # Execute only the part that sets variables (up to the rendezvous), then dump them NUL-separated.
    head = script.split("# Rendezvous")[0]
    probe = head + "\nfor v in " + " ".join(env) + '; do printf "%s\\0" "${!v}"; done\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split("\0")[:-1] == values
    assert not canary.exists()


def test_hostile_values_outside_env_are_rejected_or_quoted(tmp_path: Path) -> None:
    bad = spec.load(GOLDEN_CONF, ["container.pip=[\"x; touch /tmp/pwned\"]"], run_dir=str(RUN_DIR))
    dockerfile = render.dockerfile(bad, "H")
    assert "'x; touch /tmp/pwned'" in dockerfile
    for override in ["slurm.account=a$(id)", "slurm.extra_flags=[\"--comment=$(id)\"]", "name=a b",
                     "network.ifname=eth0;id", "container.apt=[\"x; touch /tmp/pwned\"]"]:
        with pytest.raises(ConfigError):
            spec.load(GOLDEN_CONF, [override])


def test_no_template_logic_reads_undefined_values() -> None:
    env = render.environment()
    with pytest.raises(Exception, match="undefined"):
        env.from_string("{{ nope }}").render()
    for name in ("Dockerfile.j2", "apptainer.def.j2", "sbatch.sh.j2"):
        text = (render.templates_dir() / name).read_text()
        # every {{ value }} in a shell line of the sbatch template goes through |q, except integers and
        # validated #SBATCH values
        if name == "sbatch.sh.j2":
            for line in text.splitlines():
                if line.startswith(("#", "{%")) or "{{" not in line:
                    continue
                for expr in re.findall(r"\{\{(.*?)\}\}", line):
                    validated = ("signal", "exec_prefix", "key")  # names checked by the config schema
                    assert "|q" in expr.replace(" ", "") or expr.strip() in validated, line


@pytest.mark.local
@pytest.mark.parametrize(("owner", "trains"), [("14", False), ("13", True), ("", True), (None, True)])
def test_a_superseded_job_steps_aside(owner: str | None, trains: bool, tmp_path: Path) -> None:
    """Slurm may requeue a job that `runner cron` already resubmitted: the older job id must not train."""
    text = artifacts()["job.sbatch"]
    guard = text[text.index("# One job trains"):text.index("# Each attempt")]
    if owner is not None:
        (tmp_path / "job_id").write_text(owner + "\n")
    script = f"set -uo pipefail\nRUN_DIR={tmp_path}\nSLURM_JOB_ID=13\n{guard}\necho TRAINING\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert out.returncode == (0 if trains else EXIT_SUPERSEDED)  # the exit hook records 78 as superseded
    assert ("TRAINING" in out.stdout) == trains
    assert ("superseded by job 14" in out.stderr) == (not trains)


@pytest.mark.local
@pytest.mark.parametrize(("follows", "claim_rc", "trains"), [("12", 0, True), ("12", 1, False), ("", 1, True)])
def test_a_successor_claims_the_run_or_steps_aside(follows: str, claim_rc: int, trains: bool, tmp_path: Path) -> None:
    """resume.successor: only a successor (RUNNER_SUCCESSOR_OF set) asks the claim hook, and steps aside on a no."""
    assert "RUNNER_SUCCESSOR_OF" not in artifacts()["job.sbatch"]  # off by default: not even rendered
    text = artifacts(["resume.successor=true"])["job.sbatch"]
    guard = text[text.index("# resume.successor"):text.index("# Each attempt")]
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/asked\nexit {claim_rc}\n")
    fake.chmod(0o755)
    script = f"set -uo pipefail\nRUN_DIR={tmp_path}\nRUNNER_PY={fake}\nRUNNER_SUCCESSOR_OF={follows}\n{guard}\n" \
             "echo TRAINING\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert out.returncode == (0 if trains else EXIT_SUPERSEDED)
    assert ("TRAINING" in out.stdout) == trains
    asked = (tmp_path / "asked").read_text().strip() if (tmp_path / "asked").exists() else None
    assert asked == (f"-m runner.host.jobhook claim {tmp_path}" if follows else None)


@pytest.mark.local
def test_each_batch_attempt_claims_its_own_log_folder(tmp_path: Path) -> None:
    """A requeue or resubmission runs the script again: each run claims a new logs/attempt-N, even at once."""
    text = artifacts()["job.sbatch"]
    claim = text[text.index("# Each attempt"):text.index("# Bookkeeping only")]
    script = (f"set -uo pipefail\nRUN_DIR={tmp_path}\nRUNNER_PY={sys.executable}\ngot_signal=\n{claim}\n"
              "printenv RUNNER_ATTEMPT\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt-1").mkdir()  # the first attempt
    starts = [subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    claimed = sorted(int(p.communicate(timeout=10)[0]) for p in starts)
    assert claimed == [2, 3, 4, 5]
    assert RunDir(tmp_path).attempts() == [1, 2, 3, 4, 5]
    (tmp_path / "logs").rename(tmp_path / "elsewhere")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
    assert out.returncode == 1 and out.stderr == f"runner: cannot create {tmp_path}/logs/attempt-1\n"


@pytest.mark.local
def test_the_stop_signal_waits_for_every_rank_to_be_ready(tmp_path: Path) -> None:
    """The batch script's to_ranks: written down at once; sent to the step only when all 32 ranks (4 nodes x 8) said
    they are ready, since a rank without its handler dies of SIGUSR2."""
    text = artifacts()["job.sbatch"]
    to_ranks = text[text.index("to_ranks() {"):text.index("on_signal() {")]
    assert "-ge 32 ]" in to_ranks
    attempt = tmp_path / "signals" / "attempt-1"
    (attempt / "ready").mkdir(parents=True)
    got = tmp_path / "got"
    # The step: reports the signal it gets; a plain sleep stands in for srun.
    step = subprocess.Popen(["bash", "-c", f"trap 'echo USR2 > {got}; exit 0' USR2; while true; do sleep 0.05; done"])
    try:
        script = f'set -uo pipefail\nsignal_dir={attempt}\nstep_pid={step.pid}\n{to_ranks}\nto_ranks USR2\n'
        subprocess.run(["bash", "-c", script], check=True, timeout=10)
        assert (attempt / "signal").read_text() == "USR2\n"
        for rank in range(31):
            (attempt / "ready" / f"rank-{rank:05d}").touch()
        with pytest.raises(subprocess.TimeoutExpired):  # 31 of 32 ready: nothing sent
            step.wait(timeout=1)
        (attempt / "ready" / "rank-00031").touch()
        assert step.wait(timeout=10) == 0 and got.read_text() == "USR2\n"
    finally:
        step.kill()
