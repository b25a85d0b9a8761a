#!/usr/bin/env bash
# Install Debian's chromium for the report page's browser test (tests/test_report_browser.py opens the page headless);
# fonts-liberation gives the screenshot readable text. Quiet and idempotent (scripts/install-apt.sh).
exec "$(dirname "$0")/install-apt.sh" chromium chromium fonts-liberation
