"""The typed config view mirrors the schema key for key, with matching types."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

import pytest

from runner.spec import dump, load, schema, typed

pytestmark = pytest.mark.unit

# Values that validation derives, so the typed view is narrower than what a user may write (or, for batch_size,
# wider: None in program mode, where the batch is the program's own).
DERIVED = {("trainer", "accumulate_grad_batches"): (int,), ("name",): (str,), ("command",): (list, type(None)),
           **{("dataloader", split, key): (int, type(None)) for split in ("train", "valid")  # None in program mode
              for key in ("total_shards", "dist_world_size", "batch_size")}}
FILLED = {"program"}  # keys of the view that load fills, not the user: the program's own keys


def _sections() -> list[tuple[tuple[str, ...], dict[str, Any], type]]:
    out = [((), schema.SCHEMA, typed.RunConfig)]
    hints = get_type_hints(typed.RunConfig)
    for key, sub in schema.SCHEMA.items():
        if isinstance(sub, dict) and sub.get("*") is not True:
            out.append(((key,), sub, hints[key]))
    for split in ("train", "valid"):
        out.append((("dataloader", split), schema.SCHEMA["dataloader"][split], typed.Loader))
    return out


def _types(hint: Any) -> set[type]:
    if get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(_types(a) for a in get_args(hint)))
    if hint is type(None):
        return {type(None)}
    return {get_origin(hint) or hint}


@pytest.mark.parametrize(("where", "section", "view"), _sections(), ids=lambda v: ".".join(v) if isinstance(v, tuple)
                         else "")
def test_view_mirrors_schema(where: tuple[str, ...], section: dict[str, Any], view: type) -> None:
    hints = get_type_hints(view)
    if not where:
        hints = {k: v for k, v in hints.items() if k not in FILLED}
    keys = {k for k in section if k != "*"}
    assert keys == set(hints), f"{'.'.join(where) or 'top level'}: schema and typed view differ"
    for key in keys:
        spec = section[key]
        if isinstance(spec, dict):
            continue
        expected = set(DERIVED.get((*where, key), spec.types))
        got = _types(hints[key])
        if float in expected:  # a number field holds ints too
            expected.discard(int)
            got.discard(int)
        assert got == expected, f"{'.'.join((*where, key))}: schema says {expected}, view says {got}"


def test_view_is_the_validated_dict(tmp_path: Any) -> None:
    cfg = load("conf/quickstart.yaml")
    v = typed.view(cfg.data)
    assert v is cfg.data and v["trainer"]["accumulate_grad_batches"] >= 1 and v["name"] == "quickstart"


def test_program_mode_fills_what_the_view_declares(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program's trainer and loaders lack keys the view declares: filled, so a reader never misses one."""
    monkeypatch.chdir(tmp_path)  # where the ranks start: the script is there
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "p.yaml"
    path.write_text("command: python train.py\nnum_device: 2\ntrainer: {logger: false}\n")
    v = load(path).data
    assert v["command"] == ["python", "train.py"] and v["program"] == {}
    assert (v["trainer"]["devices"], v["trainer"]["num_nodes"], v["trainer"]["max_steps"],
            v["trainer"]["max_epochs"], v["trainer"]["accumulate_grad_batches"]) == (2, 1, -1, None, 1)
    for split in ("train", "valid"):
        assert v["dataloader"][split] == {"batch_size": None, "num_workers": 0, "dist_world_size": None,
                                          "total_shards": None}  # the program's file names no sharding
    assert "model" not in v and "data" not in v


def test_read_resolved_reads_a_run_from_before_program_mode(tmp_path: Any) -> None:
    cfg = load("conf/quickstart.yaml")
    old = {k: v for k, v in cfg.data.items() if k not in ("command", "program")}
    (tmp_path / "config.yaml").write_text(dump(old))
    v = typed.read_resolved(tmp_path / "config.yaml")
    assert v["command"] is None and v["program"] == {} and v["trainer"] == cfg.data["trainer"]


def test_read_resolved_fills_every_key_a_run_from_before_it_lacks_with_the_schemas_default(tmp_path: Any) -> None:
    """No reader carries a default of its own for an old run: resume.successor, watchdog.first_step_s, fsdp and
    preflight.reuse_s did not exist once, and a run of then reads with today's defaults."""
    from runner import policy

    cfg = load("conf/quickstart.yaml")
    old = json.loads(json.dumps(cfg.data))
    del old["resume"]["successor"], old["watchdog"]["first_step_s"], old["fsdp"], old["preflight"]["reuse_s"]
    del old["command"], old["program"]
    (tmp_path / "config.yaml").write_text(dump(old))
    v = typed.read_resolved(tmp_path / "config.yaml")
    assert v["resume"]["successor"] is False and v["watchdog"]["first_step_s"] == 900
    assert v["fsdp"] == {"blocks": []} and v["preflight"]["reuse_s"] == 3600 and v["command"] is None
    assert v == cfg.data
    assert policy.Limits.of(v).successor is False
