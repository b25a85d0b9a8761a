"""Plan and run image builds (filled in by the build issue; code_files is needed by submit already)."""

from __future__ import annotations

from pathlib import Path

from runner.config import Config


def code_files(cfg: Config) -> dict[str, bytes]:
    """The files copied into the image (relative name -> content), for the content hash and the context."""
    import runner

    out: dict[str, bytes] = {}
    base = Path(cfg.path).resolve().parent
    for entry in cfg["container"]["code"]:
        src = Path(runner.__file__).resolve().parent if entry == "runner" else (base / entry)
        if src.is_file():
            out[src.name] = src.read_bytes()
            continue
        for f in sorted(src.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc",):
                out[f"{src.name}/{f.relative_to(src)}"] = f.read_bytes()
    return out
