"""Rendering: Jinja2 templates shipped as package data, StrictUndefined, and a quoting filter for
every value that reaches a shell. #SBATCH values are not shell: they are restricted to a safe
character set instead."""

from __future__ import annotations

import shlex
from functools import lru_cache
from typing import Any

import jinja2

from megalaunch.config.values import SBATCH_SAFE
from megalaunch.errors import ConfigError


def shell_quote(value: Any) -> str:
    text = str(value)
    if "\0" in text:  # no shell word, argument or environment variable can hold one: bash drops it
        raise ConfigError(f"{text!r} holds a NUL byte and cannot reach a job script", valid="text without NUL bytes",
                          fix="remove the NUL byte from the recipe value")
    return shlex.quote(text)


def sbatch_value(value: Any) -> str:
    text = str(value)
    if not SBATCH_SAFE.match(text):
        raise ConfigError(f"{text!r} cannot go into an #SBATCH line (spaces, quotes, $, ; or newlines)",
                          valid="letters, digits and . _ , : = @ / + % - [ ]", fix="fix the value in the recipe")
    return text


def comment_safe(value: Any) -> str:
    """A value shown inside a `#` comment: newlines would end the comment, so they are escaped."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("megalaunch", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch"] = sbatch_value
    env.filters["comment"] = comment_safe
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)
