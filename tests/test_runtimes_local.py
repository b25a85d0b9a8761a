"""The container runtimes, the tests that start processes (the local tier): shellcheck, offline builds, the build of a
run (the rest: tests/test_runtimes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner import spec
from runner.errors import BuildError
from runner.host import build, render
from tests.test_render import GOLDEN_CONF, lint
from tests.test_runtimes import check_golden, sbatch, wheelhouse

pytestmark = pytest.mark.local


@pytest.mark.parametrize("runtime", ["podman", "pyxis"])
def test_shellcheck(runtime: str, tmp_path: Path) -> None:
    lint("shellcheck", "-s", "bash", text=sbatch(runtime, "container.binds=['/data/a+b', '/x@y%z']"),
         tmp_path=tmp_path, name="job.sbatch")


def test_golden_offline_dockerfile(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cfg = spec.load(GOLDEN_CONF, [f"container.wheelhouse={wheelhouse(tmp_path / 'wh')}"])
    text = render.dockerfile(cfg, "GOLDEN")
    check_golden("Dockerfile-wheelhouse", text, request)
    conf = tmp_path / "hadolint.yaml"
    conf.write_text("failure-threshold: warning\n")
    lint("hadolint", "-c", str(conf), text=text, tmp_path=tmp_path, name="Dockerfile")


def test_the_wheelhouse_enters_the_spec_hash_and_the_build_context(tmp_path: Path) -> None:
    wh = wheelhouse(tmp_path / "wh")
    cfg = spec.load(GOLDEN_CONF, [f"container.wheelhouse={wh}", f"container.image_dir={tmp_path / 'img'}"])
    before = render.spec_hash(cfg, {})
    (wh / "lightning-2.6.6-py3-none-any.whl").write_bytes(b"l")
    assert render.spec_hash(cfg, {}) != before
    bp = build.plan_config(cfg)
    assert bp.wheelhouse == wh and "wheelhouse/ (the wheels of" in str(bp)
    build.write_build_dir(bp)
    assert sorted(p.name for p in (bp.paths.build_dir / "wheelhouse").iterdir()) == sorted(p.name for p in wh.iterdir())


def test_pyxis_build_prints_enroot_import_where_enroot_is_missing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no enroot, no builder
    bp = build.plan_config(spec.load(GOLDEN_CONF, ["container.runtime=pyxis", f"container.image_dir={tmp_path}",
                                                   "container.builder=podman"]))
    assert "sqsh" not in [s.name for s in bp.steps]
    assert (f"enroot not found: on a node with enroot run: enroot import --output {bp.paths.sqsh} "
            f"podman://{bp.tag}") in bp.notes


def test_build_from_run_uses_the_runs_config_and_refuses_another_spec(tmp_path: Path) -> None:
    from runner.host import submit

    overrides = [f"run_root={tmp_path}", f"container.image_dir={tmp_path / 'img'}", "container.builder=podman"]
    p = submit.plan(GOLDEN_CONF, overrides, allow_missing_image=True)
    submit.write(p)
    manifest = json.loads(p.run.manifest.read_text())
    assert manifest["runtime"] == "apptainer" and manifest["image"].endswith(f"-{manifest['spec_hash']}.sif")
    assert build.plan_from_run(p.run.root).spec_hash == manifest["spec_hash"]
    manifest["spec_hash"] = "0123456789ab"  # as if the code had changed since the run
    p.run.manifest.write_text(json.dumps(manifest))
    with pytest.raises(BuildError, match=r"give spec [0-9a-f]{12}; the run recorded spec 0123456789ab\. hint:"):
        build.plan_from_run(p.run.root)
    with pytest.raises(BuildError, match="expected a run directory"):
        build.plan_from_run(tmp_path / "nope")
