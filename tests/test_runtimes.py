"""The container runtimes' srun lines (golden files, shellcheck), offline builds, and the in-job image check.

Runs without root: what the runtimes do on a real cluster is in tests/test_containers.py; shellcheck and the offline
builds, which start processes, are in tests/test_runtimes_local.py.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path

import pytest

from runner import spec
from runner.errors import BuildError
from runner.host import build, render
from runner.job import container
from runner.rundir import RunDir, read_json
from tests.test_render import GOLDEN, GOLDEN_CONF, RUN_DIR

pytestmark = pytest.mark.unit

IMAGES = {"apptainer": "/shared/images/ngc-4x8gpu-GOLDEN.sif", "podman": "localhost/runner-ngc-4x8gpu:GOLDEN",
          "pyxis": "/shared/images/ngc-4x8gpu-GOLDEN.sqsh", "none": "none"}


def sbatch(runtime: str, *overrides: str) -> str:
    cfg = spec.load(GOLDEN_CONF, [f"container.runtime={runtime}", *overrides], run_dir=str(RUN_DIR))
    return render.sbatch(cfg, RUN_DIR, IMAGES[runtime]).replace(render.q(sys.executable), "PYTHON")


STEP = "env -u RUNNER_WEBHOOK_URL srun "  # the training step: no rank inherits the webhook's variable


def srun_line(text: str) -> str:
    """The training step's srun command (after the `env -u` that keeps the webhook's variables from the ranks)."""
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(STEP)) \
        .removeprefix("env -u RUNNER_WEBHOOK_URL ")


def check_golden(name: str, text: str, request: pytest.FixtureRequest) -> None:
    path = GOLDEN / name
    if request.config.getoption("--update-golden"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file (pytest --update-golden if intended)"


@pytest.mark.parametrize("runtime", ["podman", "pyxis"])
def test_golden_sbatch(runtime: str, request: pytest.FixtureRequest) -> None:
    check_golden(f"job-{runtime}.sbatch", sbatch(runtime), request)


@pytest.mark.parametrize("runtime", ["apptainer", "podman", "pyxis"])
def test_runtimes_change_only_the_exec_prefix(runtime: str) -> None:
    a, b = sbatch(runtime).splitlines(), sbatch("none").splitlines()
    changed = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert len(changed) == 1 and changed[0][0].strip().startswith(STEP)
    assert changed[0][0].endswith(' -m runner.job.launch "$RUN_DIR" &')


def test_each_runtime_passes_binds_env_and_the_run_dir() -> None:
    """Parsed as the shell would: odd bind paths stay one word each (spaces, quotes, `:` and `,` are refused by
    validation, since --bind and --container-mounts split on them), the run root is bound at its own path."""
    binds = ["/data/a+b", "/x@y%z"]
    words = shlex.split(srun_line(sbatch("podman", f"container.binds={json.dumps(binds)}")))
    assert words[2:10] == ["podman", "run", "--rm", "--network=host", "--ipc=host", "--uts=host", "--pid=host",
                           "--cgroupns=private"]
    for b in [*binds, str(RUN_DIR.parent)]:
        assert words[words.index(f"{b}:{b}") - 1] == "--volume"
    for name in ["SLURM_*", "MASTER_ADDR", "MASTER_PORT", "RUNNER_ATTEMPT", "RUNNER_RUN_DIR", "NCCL_NVLS_ENABLE"]:
        assert words[words.index(name) - 1] == "--env"
    assert words[words.index("--workdir") + 1] == str(RUN_DIR)
    assert words[-6:] == [IMAGES["podman"], "python", "-m", "runner.job.launch", "$RUN_DIR", "&"]

    words = shlex.split(srun_line(sbatch("pyxis", f"container.binds={json.dumps(binds)}")))
    mounts = next(w for w in words if w.startswith("--container-mounts="))
    assert mounts.split("=", 1)[1].split(",") == [f"{b}:{b}" for b in sorted([*binds, str(RUN_DIR.parent)])]
    assert f"--container-image={IMAGES['pyxis']}" in words and f"--container-workdir={RUN_DIR}" in words


def test_every_runtime_has_a_prefix_and_an_image_kind() -> None:
    assert set(render.RUNTIMES) == set(spec.schema.SCHEMA["container"]["runtime"].choices) == set(render.IMAGES)


def wheelhouse(d: Path) -> Path:
    d.mkdir()
    for name, size in (("torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", 3), ("runner-0.1.0-py3-none-any.whl", 2)):
        (d / name).write_bytes(b"x" * size)
    return d


def test_a_missing_wheelhouse_is_one_line_with_the_script_to_run(tmp_path: Path) -> None:
    cfg = spec.load(GOLDEN_CONF, [f"container.wheelhouse={tmp_path / 'none'}"])
    with pytest.raises(BuildError, match=r"found no wheels in .*hint: containers/wheelhouse.sh"):
        render.image_spec(cfg)


def test_image_reference_per_runtime(tmp_path: Path) -> None:
    def image(runtime: str) -> str:
        return build.image_path(spec.load(GOLDEN_CONF, [f"container.runtime={runtime}",
                                                        f"container.image_dir={tmp_path}"]))

    h = Path(image("apptainer")).stem.rsplit("-", 1)[1]
    assert image("apptainer") == f"{tmp_path}/ngc-4x8gpu-{h}.sif"
    assert image("pyxis") == f"{tmp_path}/ngc-4x8gpu-{h}.sqsh"
    assert image("podman") == f"localhost/runner-ngc-4x8gpu:{h}"
    assert image("none") == "none"


# --- inside the job: the image check (table) -------------------------------------------------------------

@pytest.mark.parametrize(("runtime", "want", "have", "force", "stops", "says"), [
    ("none", None, None, False, False, None),
    ("podman", "aaa", "aaa", False, False, None),
    ("podman", "aaa", "bbb", False, True, "found image spec bbb; expected spec aaa"),
    ("apptainer", "aaa", None, False, True, "found no"),
    ("podman", "aaa", "bbb", True, False, "resume.force is set: training anyway"),
    ("podman", None, "bbb", False, False, None),  # a run submitted before runner recorded spec hashes
])
def test_stale_image(runtime: str, want: str | None, have: str | None, force: bool, stops: bool, says: str | None,
                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(container, "SPEC", tmp_path / "runner-spec.json")
    if have:
        container.SPEC.write_text(json.dumps({"spec_hash": have}))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with caplog.at_level(logging.INFO):
        assert container.stale_image({"runtime": runtime, "spec_hash": want, "image": "img"}, force, run) is stops
    assert (says in caplog.text) if says else caplog.text == ""
    summary = (read_json(run.preflight, {}) or {}).get("summary", "")
    assert summary.startswith("stale image: image img: found") if stops else not run.preflight.exists()


def test_in_container_only_with_the_images_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container, "SPEC", tmp_path / "spec.json")
    monkeypatch.setattr(container, "PYTHON_PREFIX", tmp_path / "prefix")
    assert container.describe({"runtime": "podman", "image": "x"})["in_container"] is False
    container.SPEC.write_text('{"spec_hash": "abc"}')
    container.PYTHON_PREFIX.write_text("/usr\n")
    assert container.inside() is (sys.prefix == "/usr")
    container.PYTHON_PREFIX.write_text(sys.prefix + "\n")
    monkeypatch.delenv("APPTAINER_CONTAINER", raising=False)
    monkeypatch.delenv("SINGULARITY_CONTAINER", raising=False)
    assert container.describe({"runtime": "podman", "image": "x"}) == {
        "runtime": "podman", "image": "x", "in_container": True, "image_spec_hash": "abc", "apptainer_container": None}
    # Under Apptainer only with what a real Apptainer container has: its /.singularity.d and the starter's variable.
    monkeypatch.setattr(container, "APPTAINER_DIR", tmp_path / ".singularity.d")
    assert container.describe({"runtime": "apptainer", "image": "i.sif"})["in_container"] is False
    container.APPTAINER_DIR.mkdir()
    assert container.inside("apptainer") is False  # no APPTAINER_CONTAINER: not started by Apptainer
    monkeypatch.setenv("APPTAINER_CONTAINER", "/images/i.sif")
    assert container.describe({"runtime": "apptainer", "image": "i.sif"}) == {
        "runtime": "apptainer", "image": "i.sif", "in_container": True, "image_spec_hash": "abc",
        "apptainer_container": "/images/i.sif"}


HELPER_HEADS = [("podman", ["podman", "run", "--rm"]), ("apptainer", ["apptainer", "exec", "--nv"]),
                ("pyxis", ["srun", "--ntasks=1", f"--container-image={IMAGES['pyxis']}"]), ("none", [sys.executable])]


@pytest.mark.parametrize(("runtime", "head"), HELPER_HEADS)
def test_a_helper_job_starts_python_in_the_image_as_a_command(runtime: str, head: list[str]) -> None:
    """A Dask worker job's `python` (runner parallel's workers, a program's ${container_python}) is a command of its
    own: with pyxis, whose flags belong to srun, a one-task srun step; podman and pyxis set the working directory
    (Apptainer keeps the caller's)."""
    cfg = spec.load(GOLDEN_CONF, [f"container.runtime={runtime}"], run_dir=str(RUN_DIR))
    words = shlex.split(render.job_python(cfg, IMAGES[runtime], ["/data"], ["HF_HOME"], "/work"))
    assert words[:len(head)] == head
    if runtime != "none":
        assert words[-1] == "python" and IMAGES[runtime] in " ".join(words)
    if runtime in ("podman", "pyxis"):
        assert "/work" in " ".join(words)


@pytest.mark.parametrize(("overrides", "message"), [
    (["container.sign_key=KEY"], "container.verify_key: found None; expected the public key of container.sign_key"),
    (["container.verify_key=KEY", "container.runtime=podman"],
     "container.verify_key: found 'KEY'; expected container.runtime: apptainer or singularity"),
    (["container.verify_key=missing.pub"], "container.verify_key: found 'missing.pub'; expected a PEM key file"),
])
def test_signing_keys_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
                                  message: str) -> None:
    from runner.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "KEY").write_text("")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        spec.load(GOLDEN_CONF, overrides)


def test_a_verify_key_renders_the_jobs_signature_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k.pub").write_text("")
    cfg = spec.load(GOLDEN_CONF, ["container.verify_key=k.pub"])
    script = render.sbatch(cfg, Path(RUN_DIR), "/images/x.sif")
    verify = f'"$RUNNER_PY" -m runner.host.jobhook begin --nodes 4 --key {tmp_path / "k.pub"} "$RUN_DIR"'
    assert verify in script and script.index(verify) < script.index("srun --kill-on-bad-exit")  # before any rank
    assert "--key" not in render.sbatch(spec.load(GOLDEN_CONF), Path(RUN_DIR), "/images/x.sif")
