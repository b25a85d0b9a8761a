"""Alerts: the cause of a failure (``causes``), its message (``payload``) and its delivery (``delivery``)."""

from runner.alerts.core import *  # noqa: F403
