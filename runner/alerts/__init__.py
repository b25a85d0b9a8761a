"""Webhook alerts for run events: the cause of a failure (``causes``), its message (``payload``) and its
delivery (``delivery``).

Sent from both sides (the login node's cron and resubmission, the batch script's exit hook, a local run), so
this package imports neither ``runner.host`` nor ``runner.job``, and nothing heavier than the standard library
at import time. Callers pass the validated ``alerts:`` section of a config.
"""

from runner.alerts.causes import alert_from_run, guess_cause
from runner.alerts.delivery import (
    AlertConfigError,
    deferred,
    enqueue,
    flush_many,
    flush_queue,
    notify,
    queue_dir,
    resolve_url,
    secrets_of,
    send,
)
from runner.alerts.payload import NEXT_STEPS, Alert, json_payload, redact, redact_obj, slack_payload

__all__ = [
    "NEXT_STEPS",
    "Alert",
    "AlertConfigError",
    "alert_from_run",
    "deferred",
    "enqueue",
    "flush_many",
    "flush_queue",
    "guess_cause",
    "json_payload",
    "notify",
    "queue_dir",
    "redact",
    "redact_obj",
    "resolve_url",
    "secrets_of",
    "send",
    "slack_payload",
]
