"""Secrets never reach a file or a log line: the one redaction rule of the project.

A secret is
- the value of a key whose last component names one: `token`, `secret`, `password`, `passwd`, `key` (`api_key`,
  `access_key`, ...), `key_id`, `credential(s)`, `auth`, `webhook`, `webhook_url`, `alert_address` (InternLM's
  `feishu_alert_address`), matched as a whole `_`-separated word at the end, so that `tokenizer`,
  `key_value` or `max_tokens` are not secrets;
- the credentials inside a URL (`s3://KEY:SECRET@host/...`, `https://TOKEN@host/...`): the user-info part;
- a query parameter of a URL whose name is such a key (`?access_token=...`, `&key=...`, `&sign=...`);
- a whole URL of a known webhook service (Feishu/Lark, Slack, Discord, DingTalk, WeCom bots), whatever the key:
  the URL itself is the bearer secret.

Files (config.yaml, launch.json, checkpoint meta.json / config.yaml, the lease, crash reports, alert files) are
written from `redact_tree` / `redact_argv` / `redact_text` output; the log handlers carry `SecretFilter`, which
replaces every secret value seen so far (`register_secret`: the config loader registers those of each config it
loads, `register_env_secrets` those of the environment) and any URL credentials in every record.
The live Config keeps the real values in memory, so the run itself (alerts, storage) still uses them; a config
file written by a run says `<redacted>`, which the loader reads as unset (then the environment variable applies).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Iterable, Optional

REDACTED = "<redacted>"

_SECRET_WORDS = r"token|secret|password|passwd|key|key_id|api_key|apikey|credentials?|auth|webhook|webhook_url|" \
                r"alert_address|private_key|signature|sign"
SECRET_KEY = re.compile(rf"(?:^|[_\-.])(?:{_SECRET_WORDS})$", re.IGNORECASE)
# scheme://userinfo@ : userinfo has no '/', '@' or space before its ':'; a password may hold a '/' (S3 secret keys)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^\s/@:'\"]+(?::[^\s@'\"]*)?)@")
_QUERY_SECRET = re.compile(rf"(?P<head>[?&;](?:[\w\-.]*[_\-.])?(?:{_SECRET_WORDS}|access_token|sig)=)"
                           rf"(?P<value>[^&#\s'\"]+)", re.IGNORECASE)
# bots whose whole URL is the credential: anyone holding it may post to the channel
_WEBHOOK_URL = re.compile(r"https?://(?:open\.feishu\.cn|open\.larksuite\.com|hooks\.slack\.com|"
                          r"(?:\w+\.)?discord(?:app)?\.com/api/webhooks|oapi\.dingtalk\.com|qyapi\.weixin\.qq\.com)"
                          r"[^\s'\"]*", re.IGNORECASE)
_MIN_SECRET_LEN = 6  # shorter values ("1", "true", "none") would redact ordinary words in every line

_known: set[str] = set()
_known_sorted: list[str] = []
_lock = threading.Lock()


def is_secret_key(name: str) -> bool:
    """True when a config key / environment variable / option name (its last dotted component) names a secret."""
    last = str(name).rsplit(".", 1)[-1].lstrip("-").replace("-", "_")
    return bool(SECRET_KEY.search(last))


def redact_value(text: str) -> str:
    """`text` with URL credentials, secret query parameters and whole webhook-bot URLs redacted (no registry)."""
    if "://" not in text and "=" not in text:
        return text
    text = _WEBHOOK_URL.sub(REDACTED, text)
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m.group('head')}{REDACTED}", text)


def redact_text(text: str) -> str:
    """Free text (a log line, a traceback, a command line) with every registered secret and every URL credential
    redacted."""
    if not isinstance(text, str) or not text:
        return text
    for secret in _known_sorted:  # longest first: a secret containing another is replaced whole
        if secret in text:
            text = text.replace(secret, REDACTED)
    return redact_value(text)


def redact_tree(obj: Any, key: Optional[str] = None) -> Any:
    """A copy of a JSON/YAML-like tree (dicts, lists, strings, numbers) with secrets redacted: every string under a
    secret key whole, every other string by `redact_text`. Numbers, booleans and None stay (None says "unset")."""
    secret = key is not None and is_secret_key(key)
    if isinstance(obj, dict):
        return {k: redact_tree(v, str(k) if not secret else key) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_tree(v, key) for v in obj)
    if isinstance(obj, str):
        return (REDACTED if obj else obj) if secret else redact_text(obj)
    return obj


def drop_redacted(raw: dict) -> dict:
    """A config tree without the values a run redacted when it wrote it (`<redacted>`): the key takes its default
    (None for a secret), so that the environment variable or the user's own config supplies the secret again."""
    return {k: drop_redacted(v) if isinstance(v, dict) else v for k, v in raw.items() if v != REDACTED}


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line as it may be recorded: `--set a.b.webhook_url=...` / `KEY=VALUE` items and `--token=X` or
    `--token X` options with a secret name get `<redacted>` values; every item then goes through `redact_text`."""
    out: list[str] = []
    hide_next = False
    for item in map(str, argv):
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if item.startswith("--") and "=" not in item and is_secret_key(item):
            hide_next = True  # `--api-key VALUE`
            out.append(item)
            continue
        name, eq, _ = item.partition("=")
        if eq and is_secret_key(name):
            out.append(f"{name}={REDACTED}")
            continue
        out.append(redact_text(item))
    return out


def register_secret(value: Any) -> None:
    """Remember a secret value, so that every log line and `redact_text` replaces it wherever it appears."""
    global _known_sorted
    if not isinstance(value, str) or len(value) < _MIN_SECRET_LEN or value == REDACTED:
        return
    with _lock:
        if value in _known:
            return
        _known.add(value)
        _known_sorted = sorted(_known, key=len, reverse=True)


def secrets_in(obj: Any, key: Optional[str] = None) -> list[str]:
    """The secret strings of a tree: values under secret keys, and the credentials inside URLs anywhere."""
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in secrets_in(v, key if key and is_secret_key(key) else str(k))]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in secrets_in(v, key)]
    if not isinstance(obj, str) or not obj:
        return []
    if key is not None and is_secret_key(key):
        return [obj]
    found = [m.group("userinfo") for m in _URL_CREDENTIALS.finditer(obj)]
    found += [m.group("value") for m in _QUERY_SECRET.finditer(obj)]
    found += [m.group(0) for m in _WEBHOOK_URL.finditer(obj)]
    return found


def register_tree(obj: Any) -> None:
    """Register every secret of a config tree (`secrets_in`)."""
    for s in secrets_in(obj):
        register_secret(s)


def register_env_secrets(environ: Optional[dict] = None) -> None:
    """Register the values of environment variables with secret names (INTERNLM_ALERT_WEBHOOK, AWS_SECRET_ACCESS_KEY,
    S3_SECRET_ACCESS_KEY_ID, WANDB_API_KEY, HF_TOKEN, ...) and any URL credentials in the others."""
    env = os.environ if environ is None else environ
    for name, value in env.items():
        if is_secret_key(name):
            register_secret(value)
        elif "://" in value:
            register_tree({name: value})


class SecretFilter(logging.Filter):
    """A handler filter: the record's message, formatted, with secrets redacted (`redact_text`), and the traceback
    text of an exception record too."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: leave it to the handler to report
            return True
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True
