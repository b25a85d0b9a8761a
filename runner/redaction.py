"""The webhook URL is a secret (a Slack URL is a write token): the one place that knows it and takes it out of text.

Every process that writes into a run directory learns the secrets of the run's config when it reads it
(``remember_config``, called by ``runner.spec.typed.read_resolved`` and at submit), from every source: the
environment variable ``alerts.url_env`` names, ``alerts.url_file``, and ``env:`` (the value of that variable there,
and any Slack webhook URL). The writers (``rundir.atomic_write``, ``RunDir.record``, the log handler) pass what they
write through ``scrub``: the URL whole, without its scheme, its path, its token (last path segment, query values) and
each of those URL-encoded, and any Slack webhook URL by its shape. Standard library only: both sides import it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

REDACTED = "[webhook URL redacted]"
# A Slack URL is a write token wherever it appears, also URL-encoded (https%3A%2F%2Fhooks.slack.com%2F...).
SLACK_HOOK_RE = re.compile(r"(?:https?(?:://|%3A%2F%2F))?hooks\.slack(?:-gov)?\.com(?:/|%2F)[^\s\"'<>`|)\]]*", re.I)
_SLACK_HINT = re.compile(r"hooks\.slack", re.I)  # the cheap test before the full one (no copy of a large text)
TOKEN_MIN = 8  # a path segment or query value this long may be the token; shorter ones are words like "hooks"
_KNOWN: set[str] = set()  # this process's secrets (every run config it read)
_VARIANTS: list[str] = []


def secret_variants(secrets: Iterable[str]) -> list[str]:
    """The secret, the forms in which a message may quote it (no scheme, its path, its token parts), and each of
    those URL-encoded (a URL passed as a query parameter, a log of a redirect); longest first."""
    variants: set[str] = set()
    for secret in secrets:
        if not secret:
            continue
        variants.add(secret)
        parts = urlsplit(secret)
        if parts.netloc:
            # HTTP clients name the host and the path separately in their messages.
            variants.add(secret.split("://", 1)[-1])
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            if len(path) >= TOKEN_MIN:
                variants.add(path)
            # The token: the last path segment (Slack, Discord, Teams) and every query value (?token=...).
            tokens = [parts.path.rstrip("/").rsplit("/", 1)[-1], *(v for _, v in parse_qsl(parts.query))]
            variants.update(t for t in tokens if len(t) >= TOKEN_MIN)
    variants |= {quote(v, safe="") for v in variants} | {quote(v) for v in variants}
    return sorted(variants, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """Replace every Slack webhook URL, every given secret and every secret this process knows (and their forms)."""
    given = list(secrets)
    for variant in (secret_variants(given) if given else []) + _VARIANTS:
        if variant in text:
            text = text.replace(variant, REDACTED)
    return SLACK_HOOK_RE.sub(REDACTED, text)


def redact_obj(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """``redact`` applied to every string (keys too) of a JSON-like value."""
    secrets = list(secrets)
    if isinstance(obj, str):
        return redact(obj, secrets)
    if isinstance(obj, list):
        return [redact_obj(item, secrets) for item in obj]
    if isinstance(obj, dict):
        return {redact(str(k), secrets): redact_obj(v, secrets) for k, v in obj.items()}
    return obj


def scrub(text: str) -> str:
    """What a writer of a run directory writes: every secret this process knows taken out (cheap when none)."""
    if not _VARIANTS and not _SLACK_HINT.search(text):
        return text
    return redact(text)


def remember(secrets: Iterable[str]) -> None:
    """Secrets (webhook URLs) to take out of everything this process writes from now on."""
    new = {s.strip() for s in secrets if isinstance(s, str) and len(s.strip()) >= TOKEN_MIN} - _KNOWN
    if new:
        _KNOWN.update(new)
        _VARIANTS[:] = secret_variants(_KNOWN)


class Scrubbed:
    """A text stream that passes on what it is given without the secrets this process knows (``scrub``): the second
    wall where text that runner did not write (a program's output, a rank log read back) passes through runner.

    A secret (a URL) holds no whitespace, yet may come in two writes: the text after the last whitespace waits for
    the next write. ``flush`` passes it on too (a rank's last words before its exit must reach its log), unless
    ``hold``: a reader that flushes after every chunk (``runner logs --follow``) passes it on at ``close``. Every
    other attribute is the wrapped stream's (``fileno``, ``isatty``, ``encoding``)."""

    KEEP = 8192  # text without whitespace held at most: a longer run is passed on but for its last KEEP characters

    def __init__(self, out: Any, hold: bool = False) -> None:
        import threading

        self.out, self.hold = out, hold
        self._held = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            held = self._held + text
            start = max(0, len(held) - self.KEEP)
            cut = max(max(held.rfind(c, start) for c in " \t\n\r\f\v") + 1, start)
            self._held = held[cut:]
            if cut:
                self.out.write(scrub(held[:cut]))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.hold:
            self._pass_on()
        self.out.flush()

    def close(self) -> None:
        """Pass on what is held (the stream itself stays open: it is the wrapped one's to close)."""
        self._pass_on()
        self.out.flush()

    def _pass_on(self) -> None:
        with self._lock:
            held, self._held = self._held, ""
            if held:
                self.out.write(scrub(held))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


DEFAULT_URL_ENV = "RUNNER_WEBHOOK_URL"  # alerts.url_env's default


def config_secrets(cfg: Mapping[str, Any]) -> list[str]:
    """The webhook URLs a run's config leads to, from every source; never raises, never validates (an alert does)."""
    alerts, env, name = _webhook_settings(cfg)
    found = [os.environ.get(name, ""), os.environ.get(DEFAULT_URL_ENV, ""), str(env.get(name) or "")]
    found += [str(v) for v in env.values() if isinstance(v, str) and SLACK_HOOK_RE.search(v)]
    url_file = alerts.get("url_file")
    if isinstance(url_file, str) and url_file:
        try:
            path = Path(os.path.expanduser(url_file))
            st = path.stat()
            if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 10:  # a FIFO is never opened
                return [f for f in found if f.strip()]
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")][:1]
        except Exception:  # noqa: S110 -- no file, no secret from it; resolve_url says what is wrong when sending
            pass
    return [f for f in found if f.strip()]


def webhook_names(cfg: Mapping[str, Any]) -> list[str]:
    """The environment variables that carry the webhook URL to runner's own alerts (``alerts.url_env`` and the
    default): the one rule for what a rank and its program never inherit from the shell that submitted. A program
    printing its environment, or an exception quoting it, would put the URL in a rank log. A run that wants such a
    variable in its ranks names it in ``env:`` (kept out of the run's readable files by ``secret.env``)."""
    _, env, name = _webhook_settings(cfg)
    return sorted({DEFAULT_URL_ENV, name} - set(env))


def _webhook_settings(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any], str]:
    """A config's ``alerts`` and ``env`` sections (empty where they are not mappings) and the variable that holds the
    webhook URL (``alerts.url_env``, or the default where it is not a name)."""
    alerts: Mapping[str, Any] = cfg["alerts"] if isinstance(cfg.get("alerts"), Mapping) else {}
    env: Mapping[str, Any] = cfg["env"] if isinstance(cfg.get("env"), Mapping) else {}
    name = alerts.get("url_env")
    return alerts, env, name if isinstance(name, str) and name else DEFAULT_URL_ENV


def remember_config(cfg: Mapping[str, Any], run_dir: Path | None = None) -> None:
    """The secrets of a run's config, and (``run_dir``) of its ``secret.env``: where an ``env:`` secret went, since
    the config.yaml beside it holds only the redacted value."""
    remember(config_secrets(cfg))
    if run_dir is not None:
        remember(secret_env_values(run_dir / "secret.env"))


def secret_env_items(path: Path) -> dict[str, str]:
    """The variables of a ``secret.env`` (``export NAME=VALUE`` lines, shell-quoted); none when there is none."""
    import shlex

    try:
        if not stat.S_ISREG(path.stat().st_mode) or path.stat().st_size > 1 << 20:
            return {}
        words = [shlex.split(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        return {}
    return dict(w[1].partition("=")[::2] for w in words if len(w) == 2 and w[0] == "export")


def secret_env_values(path: Path) -> list[str]:
    return list(secret_env_items(path).values())
