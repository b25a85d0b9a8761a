"""The typed config view mirrors the schema key for key, with matching types."""

from __future__ import annotations

import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

import pytest

from runner.spec import load, schema, typed

# Values that validation derives, so the typed view is narrower than what a user may write.
DERIVED = {("trainer", "accumulate_grad_batches"): (int,), ("name",): (str,),
           **{("dataloader", split, key): (int,) for split in ("train", "valid")
              for key in ("total_shards", "dist_world_size")}}


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
