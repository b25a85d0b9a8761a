"""Where the user's code came from: the git commit, whether the checkout was dirty, and what changed.

Runs on the login node. A run's manifest (``runner.host.submit``) and an image's labels (``runner.host.build``)
both record it, so that a run or an image says exactly which code it holds.

The diff itself is not in the manifest: an uncommitted change may be a ``.env`` with a token, and a manifest is
shared, printed by ``--dry-run`` and copied around. The manifest names the changed files and the diff's sha256;
the diff goes to ``git.diff`` in the run directory, mode 0600, the webhook URL redacted (``submit.write``), so a
dirty run can still be reproduced by its owner and the hash proves which diff it was.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from runner import proc
from runner.records import GitState


def git_provenance(path: Path) -> tuple[GitState, str]:
    """Commit, dirty flag, changed files and the diff's sha256 of the checkout holding ``path`` (all None outside
    git, or without git), and the diff's text for the caller to keep privately ("" when there is none)."""
    def git(*args: str) -> str | None:
        out = proc.run(["git", "-C", str(path), *args], timeout=10, check=False)
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff_files": None, "diff_sha256": None}, ""
    diff = git("diff", "HEAD") or ""
    files = (git("diff", "HEAD", "--name-only") or "").split()
    return {"commit": commit.strip(), "dirty": bool(diff.strip()), "diff_files": files,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}, diff
