"""`megalaunch data rollouts`: GRPO rollout files -> chat data with advantages (tokenization/rollout_build.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from megalaunch.cli.output import emit_json, say


def rollouts(
    inputs: Annotated[list[str], typer.Argument(metavar="FILE...", help="Rollout JSONL or parquet files: "
                                                "a prompt, its completions and a reward each "
                                                "(docs/post_training.md, GRPO).")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", metavar="DIR", help="The model's Hugging Face "
                                           "directory (tokenizer files with its chat template).")],
    output: Annotated[str, typer.Option("--output", metavar="DIR", help="Where OUT/<name>.bin/.idx/.mask and "
                                        "the .adv/.reward/.oldlogp side files go.")],
    name: Annotated[str | None, typer.Option("--name", help="The output's name (one input only; default: the "
                                             "file's stem).")] = None,
    seq_length: Annotated[int | None, typer.Option("--seq-length", help="Count the conversations longer than "
                                                   "this (training truncates them).")] = None,
    multiple_of: Annotated[int | None, typer.Option("--multiple-of", help="Refuse a file whose completions are not "
                                                    "a multiple of this (the run's global batch size).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Check rollout files row by row, compute the group-normalised advantages and tokenize each completion
    with the model's chat template (the prompt as context, the completion as the trained answer). A file with
    a bad row (no reward, a group of one, token ids that are not the template's, ...) is refused whole, its
    rows named."""
    from dataclasses import asdict

    from megalaunch.data.rollouts import SHAPES, RolloutError
    from megalaunch.errors import PreflightError
    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    if name is not None and len(inputs) != 1:
        raise PreflightError("--name names the output of one input file", field="--name", fix="give one file")
    renderer = ChatRenderer(tokenizer)
    results = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.is_file():
            raise PreflightError(f"{raw} is not a file", field="inputs", fix="give rollout JSONL or parquet files")
        stem = name or (path.name[: -len(path.suffix)] if path.suffix else path.name)
        try:
            results.append(tokenize_rollouts(path, Path(output).expanduser() / stem, renderer,
                                             seq_length=seq_length, multiple_of=multiple_of))
        except RolloutError as e:
            raise PreflightError(str(e), field="inputs", valid=SHAPES, fix="correct those rows") from None
    if as_json:
        emit_json([asdict(r) for r in results])
        return
    for r in results:
        say(f"{r.source}: {r.groups:,} groups, {r.conversations:,} completions, {r.tokens:,} tokens "
            f"({r.trained_tokens:,} trained), mean reward {r.reward_mean:.4g}"
            + (", old log-probabilities given" if r.old_logprobs else "") + f" -> {r.prefix}")
