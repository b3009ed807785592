"""Checks of the recipe's ways to tell a person (chain.notify, cluster.mail_user), before anything is
written: a webhook URL that carries a secret never reaches run.yaml, an address or mail type that
sbatch would refuse never reaches job.sbatch. Part of preflight (config/preflight.py)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError

_EMAIL_RE = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+\Z")  # also #SBATCH-safe
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
# Hosts whose hook URLs hold their token in the path: such a URL is a secret wherever it is written.
_HOOK_HOSTS = ("hooks.slack.com", "webhook.office.com", "discord.com", "discordapp.com", "chat.googleapis.com")
_TOKEN_SEGMENT_RE = re.compile(r"^(?=.*[A-Za-z])(?=.*[0-9])[A-Za-z0-9_-]{16,}$")  # long, random-looking
_USE_ENV = "put the URL in an environment variable and name it: --set 'chain.notify.webhook_env=[TEAM_HOOK]'"


def _require(ok: bool, field: str, message: str, valid: str, fix: str) -> None:
    if not ok:
        raise PreflightError(message, field=field, valid=valid, fix=fix)


def check_notify(recipe: Recipe) -> None:
    check_mail(recipe)
    n = recipe.chain.notify
    for i, name in enumerate(n.webhook_env):
        _require(bool(_ENV_RE.match(name)), f"chain.notify.webhook_env[{i}]",
                 f"{name!r} is not an environment variable name", "a NAME of letters, digits and _ (not the URL)",
                 "export TEAM_HOOK=https://... in the shell you submit from, then --set "
                 "'chain.notify.webhook_env=[TEAM_HOOK]'")
    for i, url in enumerate(n.webhooks):
        check_literal_webhook(url, f"chain.notify.webhooks[{i}]")
    for i, argv in enumerate(n.commands):
        _require(bool(argv) and bool(argv[0].strip()), f"chain.notify.commands[{i}]", "is an empty command",
                 "an argument list, e.g. [/usr/bin/logger, -t, megalaunch] (no shell: the JSON comes on stdin)",
                 "give the program and its arguments, or remove the entry")
    for name in ("timeout_s", "command_timeout_s"):
        value = getattr(n, name)
        _require(0 < value <= 600, f"chain.notify.{name}", f"is {value}", "seconds, > 0 and <= 600",
                 f"--set chain.notify.{name}={10 if name == 'timeout_s' else 30}")


def check_literal_webhook(url: str, field: str) -> None:
    """A webhook written in the recipe lands in run.yaml, which the run's group reads: only a URL that
    holds no credential (an internal relay) may be written there."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        parts, host = None, ""
    _require(parts is not None and parts.scheme in ("http", "https") and bool(host), field,
             f"{url!r} is not an http(s) URL", "http://HOST[:PORT]/PATH", "fix the URL")
    assert parts is not None
    secret = _secret_in(parts.netloc, parts.query, host, parts.path)
    _require(secret is None, field, f"the URL holds {secret}, which run.yaml (readable by the run's group) "
             "would then hold", "a URL without credentials, or the NAME of a variable in chain.notify.webhook_env",
             _USE_ENV)


def _secret_in(netloc: str, query: str, host: str, path: str) -> str | None:
    if "@" in netloc:
        return "user:password@"
    if query:
        return "a ?query"
    if any(host == h or host.endswith("." + h) for h in _HOOK_HOSTS):
        return f"a {host} hook's token"
    if any(_TOKEN_SEGMENT_RE.match(s) for s in path.split("/")):
        return "a token-like path segment"
    return None


def check_mail(recipe: Recipe) -> None:
    """#SBATCH --mail-user/--mail-type: an address and Slurm's mail types only (sbatch, not a shell, reads
    them, but a value it cannot parse would fail the submission)."""
    cl = recipe.cluster
    if cl.mail_user is None:
        return
    _require(bool(_EMAIL_RE.match(cl.mail_user)), "cluster.mail_user", f"{cl.mail_user!r} is not an email address",
             "an address like name@example.org (letters, digits and . _ % + - before the @)",
             "--set cluster.mail_user=you@example.org (or null for no mail)")
    types = cl.mail_type.split(",")
    bad = [t for t in types if t not in MAIL_TYPES]
    _require(not bad, "cluster.mail_type", f"{', '.join(map(repr, bad)) or repr(cl.mail_type)} is not a Slurm "
             "mail type", f"a comma-separated list of {' '.join(MAIL_TYPES)}", "--set cluster.mail_type=END,FAIL")
    both = sorted({"mail-user", "mail-type"} & set(cl.sbatch_extra))
    _require(not both, f"cluster.sbatch_extra.{both[0] if both else ''}", "repeats cluster.mail_user/mail_type",
             "one of them", "remove it from cluster.sbatch_extra")
