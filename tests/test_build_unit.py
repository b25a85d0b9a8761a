"""`runner build`, the unit tier: the progress display, in process (the rest: tests/test_build.py,
tests/test_build_podman.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runner.host import build

pytestmark = pytest.mark.unit


def test_progress_shows_live_output_on_a_terminal(tmp_path: Path) -> None:
    class Tty:
        def __init__(self) -> None:
            self.text = ""
            self.live = threading.Event()  # the live line was drawn: "\r" and the step's latest output

        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> None:
            self.text += s
            if s.startswith("\r") and "STEP 3/9" in s:
                self.live.set()

        def flush(self) -> None:
            pass

    out = Tty()
    progress = build.Progress(2, out)  # type: ignore[arg-type]
    progress.start(1, build.Step("image", "build the image", ["x"]), tmp_path / "image.log")
    progress.line("STEP 3/9: RUN pip install\n")
    assert out.live.wait(30), out.text  # drawn every 0.5 s
    progress.finish(True)
    assert "[1/2] image: build the image" in out.text and "STEP 3/9: RUN pip install" in out.text
    assert "\r" in out.text and "done in 0." in out.text
