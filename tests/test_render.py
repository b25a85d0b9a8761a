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
    (GOLDEN_CONF, ["resume.in_job=true", "slurm.spare_nodes=1"]),
]


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
    srun = next(line.strip() for line in text.splitlines() if " srun --kill" in line)
    assert "apptainer exec --nv --bind" in srun and "/shared/images/ngc-4x8gpu-GOLDEN.sif" in srun
    assert '--env "MASTER_ADDR=$MASTER_ADDR"' in srun


def test_runtimes_differ_only_in_exec_prefix() -> None:
    a = artifacts(["container.runtime=apptainer"])["job.sbatch"].splitlines()
    b = artifacts(["container.runtime=none"])["job.sbatch"].splitlines()
    changed = [(x.strip(), y.strip()) for x, y in zip(a, b, strict=True) if x != y]
    assert len(changed) == 1 and all(x.startswith("env -u RUNNER_WEBHOOK_URL srun ") for x in changed[0])
    assert changed[0][1].split(" -m runner.job.launch")[1] == changed[0][0].split(" -m runner.job.launch")[1]


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
                    # names checked by the config schema; launch: exec_prefix and fixed words ({% set %})
                    validated = ("signal", "exec_prefix", "key", "launch")
                    assert "|q" in expr.replace(" ", "") or expr.strip() in validated, line


def _begin_env(tmp_path: Path, **more: str) -> dict[str, str]:
    """A batch host's environment for ``jobhook begin``: job 13 on one node (no scontrol needed for one name)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUNNER_"))}
    return {**env, "SLURM_JOB_ID": "13", "SLURM_JOB_NODELIST": "n1", "PYTHONPATH": str(REPO), **more}


@pytest.mark.parametrize(("follows", "claim_rc", "trains"), [("12", 0, True), ("12", EXIT_SUPERSEDED, False),
                                                             ("", EXIT_SUPERSEDED, True)])
def test_a_successor_claims_the_run_or_steps_aside(follows: str, claim_rc: int, trains: bool, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """resume.successor: only a successor (RUNNER_SUCCESSOR_OF set) asks to claim the run, and steps aside on a no."""
    from runner.host import jobhook

    asked: list[Path] = []
    monkeypatch.setattr(jobhook, "claim", lambda run: asked.append(run.root) or claim_rc)
    for key, value in _begin_env(tmp_path, RUNNER_SUCCESSOR_OF=follows).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "logs").mkdir()
    code, env = jobhook.begin(RunDir(tmp_path), "")
    assert code == (0 if trains else EXIT_SUPERSEDED) and bool(env) == trains
    assert asked == ([tmp_path] if follows else [])


def test_an_attempt_gets_its_rendezvous_from_its_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's variables come from one builder (runner.world): the first node, ports from the job id."""
    from runner.host import jobhook

    for key, value in _begin_env(tmp_path, SLURM_JOB_ID="20013").items():
        monkeypatch.setenv(key, value)
    (tmp_path / "logs").mkdir()
    code, env = jobhook.begin(RunDir(tmp_path), "")
    assert code == 0 and env == {"MASTER_ADDR": "n1", "MASTER_PORT": "10026", "RUNNER_PREFLIGHT_PORT": "10027",
                                 "RUNNER_RUN_DIR": str(tmp_path), "RUNNER_ATTEMPT": "1", "RUNNER_STEP_NODES": "n1"}
    monkeypatch.setenv("SLURM_JOB_NODELIST", "")
    assert jobhook.begin(RunDir(tmp_path), "") == (1, {})  # no rendezvous: no rank starts


def test_spare_nodes_allocate_more_and_each_step_trains_on_num_nodes() -> None:
    """slurm.spare_nodes: N + K nodes, --no-kill (a lost node leaves the job alive), srun on exactly N of them (the
    nodes `begin` chose); without spares the job and its step are as before."""
    plain = artifacts()["job.sbatch"].splitlines()
    spare = artifacts(["slurm.spare_nodes=2"])["job.sbatch"].splitlines()
    assert "#SBATCH --nodes=4" in plain and "#SBATCH --no-kill" not in plain
    assert "#SBATCH --nodes=6" in spare and "#SBATCH --no-kill" in spare
    srun = next(line.strip() for line in spare if " srun --kill" in line)
    assert ' srun --kill-on-bad-exit=1 --nodes=4 --ntasks=32 --nodelist="$RUNNER_STEP_NODES" apptainer ' in srun
    both = artifacts(["slurm.spare_nodes=1", "resume.in_job=true"])["job.sbatch"]
    assert ' srun --kill-on-bad-exit=1 --nodes=4 --ntasks=32 --overlap --nodelist="$RUNNER_STEP_NODES" ' in both
    assert "--nodelist" not in next(line for line in plain if " srun --kill" in line)
    assert any("begin --nodes 4 " in line for line in spare)
    unfinished = '[ "$rc" -ne 0 ] || [ -e "$RUN_DIR/finished" ] || rc=1'  # srun's 0 after a lost node under --no-kill
    assert unfinished in spare and unfinished not in plain


def test_in_job_restart_loops_only_when_configured() -> None:
    """resume.in_job: the exit hook is asked after each step (--again) and exit 10 trains again; off, the script
    runs one step and its EXIT trap records it, as before."""
    off = artifacts()["job.sbatch"]
    on = artifacts(["resume.in_job=true"])["job.sbatch"]
    assert "--again" not in off and "  break\n" in off
    assert 'hook exit --rc "$rc" --signal "${got_signal:-none}" --again' in on and "[ $? -eq 10 ] || break" in on


@pytest.mark.parametrize(("requeue", "said", "flag"), [
    (True, "slurm 22.05.8\n", "--requeue"),
    (True, "slurm 25.05.3\n", "--requeue"),
    (True, "slurm 25.11.0\n", "--requeue=expedite"),
    (True, "slurm-wlm 26.05.1\n", "--requeue=expedite"),
    (True, "slurm 24.11.6-1\n", "--requeue"),
    (True, "", "--requeue"),  # sbatch said nothing (or could not be asked): nothing new
    (True, "sbatch: command not found", "--requeue"),
    (False, "slurm 25.11.0\n", "--no-requeue"),
])
def test_requeue_expedite_where_slurm_has_it(requeue: bool, said: str, flag: str) -> None:
    """Slurm 25.11+ requeues a job at top priority on its nodes (--requeue=expedite); older Slurm gets --requeue."""
    from runner.host import slurm

    assert render.requeue_flag(requeue, slurm.parse_version(said)) == flag
    cfg = spec.load(GOLDEN_CONF, [f"slurm.requeue={str(requeue).lower()}"], run_dir=str(RUN_DIR))
    assert flag in render.directives(cfg, slurm.parse_version(said))
