#!/usr/bin/env bash
# The local stand-in for the NGC base image; the recipe lives in containers/test-base.sh.
# Usage: scripts/make-base-image.sh [TAG]    (default: localhost/runner-test-base:bookworm)
exec "$(dirname "$0")/../containers/test-base.sh" "$@"
