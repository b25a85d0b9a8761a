#!/usr/bin/env bash
# Install tmux for the quickstart's terminal test (tests/test_quickstart_tmux.py runs scripts/quickstart.sh in a tmux
# pane as a person would, presses Ctrl-C and reads the screen). Quiet and idempotent (scripts/install-apt.sh).
exec "$(dirname "$0")/install-apt.sh" tmux tmux
