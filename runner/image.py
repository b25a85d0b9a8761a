"""Where a runner image keeps what it says about itself: read by the ranks inside it (``runner.job.container``)
and by the login node's local runs (``runner.host.local``), written by ``runner build`` (templates/Dockerfile.j2
copies the spec to ``SPEC``)."""

from __future__ import annotations

from pathlib import Path

SPEC = Path("/etc/runner-spec.json")  # the image's spec (its hash is the run's manifest spec_hash)
PYTHON_PREFIX = Path("/etc/runner-python-prefix")  # the image's sys.prefix: a rank is inside when its own matches
