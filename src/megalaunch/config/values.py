"""What a recipe's values may hold, checked before anything is written: nothing that would become extra
Megatron arguments or #SBATCH options, and no secret value (a recipe is copied into the run directory).
Part of preflight (config/preflight.py); each failure is one PreflightError."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from megalaunch.config.schema import Recipe
from megalaunch.config.typed import to_plain
from megalaunch.errors import PreflightError

# Values that look like credentials. A recipe names secret variables (cluster.secret_env); it never holds one.
_SECRET_VALUE_RES = [
    re.compile(r"^hf_[A-Za-z0-9]{20,}$"),  # Hugging Face token
    re.compile(r"^(sk|pk)-[A-Za-z0-9_-]{20,}$"),  # OpenAI-style keys
    re.compile(r"^gh[pousr]_[A-Za-z0-9]{20,}$"),  # GitHub tokens
    re.compile(r"^xox[abprs]-[A-Za-z0-9-]{10,}$"),  # Slack
    re.compile(r"^AKIA[0-9A-Z]{16}$"),  # AWS access key id
    re.compile(r"^(local|wandb)-[0-9a-f]{40}$"),  # W&B API key (prefixed)
]
# 40 hex digits: a W&B API key, or a git commit. Name and value decide together: a key is refused
# whatever it is called, unless the name says it is a revision (GIT_COMMIT, MODEL_SHA, ...).
_HEX40_RE = re.compile(r"^[0-9a-f]{40}$")
_REVISION_NAME_RE = re.compile(r"(COMMIT|SHA|REV|HASH|DIGEST|CHECKSUM)", re.I)
_SECRET_NAME_RE = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)


_ARGS_SECTIONS = ("model", "parallel", "training", "checkpoint", "data", "megatron_args")


def check_single_tokens(recipe: Recipe) -> None:
    """Every value that goes into RUN/megatron.args (one token per line) must stay one token: a line
    break or NUL would turn it into extra Megatron arguments."""
    flags = [(f"megatron_args.{name}", name) for name in recipe.megatron_args]  # each key becomes a flag
    for field, value in [*_walk(to_plain(recipe)), *flags]:
        section = field.split(".")[0].split("[")[0]
        bound = section in _ARGS_SECTIONS or field == "run.root"  # the run directory is in --save/--load
        if bound and isinstance(value, str) and any(c in value for c in "\n\r\0"):
            raise PreflightError(f"{value!r} holds a line break or NUL: it would become extra Megatron arguments",
                                 field=field, valid="a value on one line", fix="remove the line break")
        if isinstance(value, str) and "\0" in value:  # no argument, variable, path or script line can hold one
            raise PreflightError(f"{value!r} holds a NUL byte", field=field, valid="text without NUL bytes",
                                 fix="remove the NUL byte")


SBATCH_SAFE = re.compile(r"^[A-Za-z0-9._,:=@/+%\-\[\]]+\Z")  # parsed by sbatch, not a shell; \Z: no final newline


def check_sbatch_values(recipe: Recipe) -> None:
    """#SBATCH lines are parsed by sbatch, not a shell: values are limited to a safe character set."""
    cl = recipe.cluster
    values = {f"cluster.{k}": getattr(cl, k) for k in ("partition", "account", "qos", "reservation",
                                                        "constraint", "mem", "time")}
    values.update({f"cluster.sbatch_extra.{k}": v for k, v in cl.sbatch_extra.items()})
    values.update({"eval.partition": recipe.eval.partition, "eval.time": recipe.eval.time})  # eval.sbatch's
    for field, value in values.items():
        if value is not None and not SBATCH_SAFE.match(str(value)):
            raise PreflightError(f"{value!r} cannot go into an #SBATCH line (spaces, quotes, $, ; or newlines)",
                                 field=field, valid="letters, digits and . _ , : = @ / + % - [ ]",
                                 fix="fix the value in the recipe")
    # Derived: the segment logs' path (RUN_ROOT/NAME-HASH/logs/%x-%j.out) is an #SBATCH --output line,
    # so the run root must be safe there too; the error names the field the user set, not the log path.
    if cl.traits.job_script and not SBATCH_SAFE.match(recipe.run.root):
        raise PreflightError(f"{recipe.run.root!r}: the segment logs under it are named in #SBATCH --output, "
                             "which cannot hold spaces, quotes, $, ; or newlines",
                             field="run.root", valid="a directory path of letters, digits and . _ , : = @ / + % - [ ]",
                             fix="choose a run.root without those characters (e.g. a symlink to the directory)")


def _walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


def check_no_secrets(recipe: Recipe) -> None:
    for path, value in _walk(to_plain(recipe)):
        if not isinstance(value, str):
            continue
        leaf = path.rsplit(".", 1)[-1]
        text = value.strip()
        looks_secret = any(r.match(text) for r in _SECRET_VALUE_RES) or (
            _HEX40_RE.match(text) is not None and _REVISION_NAME_RE.search(leaf) is None)
        named_secret = _SECRET_NAME_RE.search(leaf) is not None and path.startswith(("cluster.env", "megatron_args"))
        if looks_secret or (named_secret and value):
            raise PreflightError("holds what looks like a secret value; recipes are copied into the run directory",
                                 field=path, valid="the NAME of an environment variable in cluster.secret_env",
                                 fix=f"remove the value and add '{leaf if named_secret else 'VAR_NAME'}' to "
                                     "cluster.secret_env; export it in the shell you submit from")
