"""Webhook alerts for run events: the cause of a failure (``causes``), its message (``payload``) and its
delivery (``delivery``).

Sent from both sides (the login node's cron and resubmission, the batch script's exit hook, a local run), so
this package imports neither ``runner.host`` nor ``runner.job``, and nothing heavier than the standard library
at import time. Callers pass the validated ``alerts:`` section of a config.
"""

from runner.alerts.causes import alert_from_run, guess_cause
from runner.alerts.delivery import AlertConfigError, flush_queue, notify, queue_dir, resolve_url, send
from runner.alerts.payload import NEXT_STEPS, Alert, json_payload, slack_payload

__all__ = [
    "NEXT_STEPS",
    "Alert",
    "AlertConfigError",
    "alert_from_run",
    "flush_queue",
    "guess_cause",
    "json_payload",
    "notify",
    "queue_dir",
    "resolve_url",
    "send",
    "slack_payload",
]
