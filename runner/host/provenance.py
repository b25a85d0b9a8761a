"""Where the user's code came from: the git commit, whether the checkout was dirty, and the diff.

Runs on the login node. A run's manifest (``runner.host.submit``) and an image's labels (``runner.host.build``)
both record it, so that a run or an image says exactly which code it holds.
"""

from __future__ import annotations

from pathlib import Path

from runner import proc


def git_provenance(path: Path) -> dict[str, object]:
    """Commit, dirty flag and diff of the checkout holding ``path``; all None outside git (or without git)."""
    def git(*args: str) -> str | None:
        out = proc.run(["git", "-C", str(path), *args], timeout=10, check=False)
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff": None}
    diff = git("diff", "HEAD") or ""
    return {"commit": commit.strip(), "dirty": bool(diff.strip()), "diff": diff}
