"""The quickstart as a person runs it (issue 31): `scripts/quickstart.sh` typed into a real terminal (a tmux pane), live
progress on the screen while it trains, Ctrl-C pressed, and the screen read: the stop message, then the status table
with the run `interrupted`, then the script's closing lines.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ci import need
from tests.conftest import fixture_tier
from tests.waiting import until

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.local


class Terminal:
    """One tmux server of its own (its own socket), one pane of 200 x 50 running bash."""

    def __init__(self, socket: Path) -> None:
        self.base = ["tmux", "-S", str(socket)]
        subprocess.run([*self.base, "new-session", "-d", "-x", "200", "-y", "50", "-s", "t", "bash", "--norc"],
                       check=True, timeout=30)

    def type(self, text: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "t", "-l", text], check=True, timeout=30)
        subprocess.run([*self.base, "send-keys", "-t", "t", "Enter"], check=True, timeout=30)

    def key(self, name: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "t", name], check=True, timeout=30)

    def screen(self) -> str:
        """What the pane shows, with its scrollback."""
        out = subprocess.run([*self.base, "capture-pane", "-p", "-J", "-S", "-2000", "-t", "t"], capture_output=True,
                             text=True, check=True, timeout=30)
        return out.stdout

    def wait_for(self, what: str, ok: Callable[[str], bool], timeout: float = 240) -> str:
        """The screen once it shows `what` (`ok` says so)."""
        def showing() -> str | None:
            screen = self.screen()
            return screen if ok(screen) else None
        return until(f"the screen to show {what}", showing, timeout, every=0.2, detail=self.screen)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], check=False, timeout=30)


@pytest.fixture
@fixture_tier("local")
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    need(shutil.which("tmux") is not None, "tmux is not installed (scripts/install-tmux.sh installs it)")
    t = Terminal(tmp_path / "tmux.sock")
    try:
        yield t
    finally:
        t.close()


def test_quickstart_in_a_terminal_ctrl_c_then_the_status_table(terminal: Terminal, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    terminal.type(f"cd {shlex.quote(str(REPO))} && RUN_ROOT={shlex.quote(str(root))} scripts/quickstart.sh "
                  "trainer.max_steps=100000 model.step_time_s=0.05; echo QUICKSTART-EXIT=$?")
    # Live progress: a bar on a terminal (step, percent, steps/s, ETA), rewritten in place.
    terminal.wait_for("the progress bar", lambda s: "steps/s" in s and "ETA" in s and "] " in s)
    terminal.key("C-c")
    screen = terminal.wait_for("the script's end", lambda s: re.search(r"QUICKSTART-EXIT=\d", s) is not None)
    stop = screen.index("stopping: the ranks checkpoint at the next step")
    table = screen.index("RUN ", stop)
    row = next(line for line in screen[table:].splitlines() if line.startswith("quickstart-"))
    assert "interrupted" in row.split(), screen
    assert screen.index("What to look at next:") > table
    assert "QUICKSTART-EXIT=75" in screen  # checkpointed; the script went on to the table all the same
    assert "Traceback" not in screen
