"""`megalaunch data sft`: chat data -> token datasets with an assistant-only loss mask (tokenization/chat/build.py)."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer

from megalaunch.cli.output import emit_json, say


def sft(
    inputs: Annotated[list[str], typer.Argument(metavar="FILE|DIR...", help="JSONL or parquet files of "
                                                "conversations ({'messages': [{role, content}, ...]}) or "
                                                "prompt/response pairs, or folders of them.")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", metavar="DIR", help="The model's Hugging Face "
                                           "directory (tokenizer files with its chat template).")],
    output: Annotated[str, typer.Option("--output", metavar="DIR", help="Where OUT/<name>.bin/.idx/.mask go; "
                                        "run again to resume.")],
    seq_length: Annotated[int | None, typer.Option("--seq-length", help="Count the conversations longer than "
                                                   "this (training truncates them).")] = None,
    skip_malformed: Annotated[bool, typer.Option("--skip-malformed", help="Leave malformed rows out (counted "
                                                 "and listed) instead of refusing their file.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Render conversations with the model's own chat template, tokenize them, and mask the loss to the
    assistant's tokens. One output per input file, written whole or not at all; a relaunch skips the
    files already done. A malformed row (no role, empty messages, not UTF-8, ...) is named by its row
    number and its file is refused unless --skip-malformed."""
    from dataclasses import asdict

    from megalaunch.tokenization.chat.build import build

    results = build(inputs, output, tokenizer=tokenizer, seq_length=seq_length, skip_malformed=skip_malformed)
    if as_json:
        emit_json([asdict(r) for r in results])
        return
    say(f"{'conversations':>14}{'tokens':>12}{'trained':>12}{'malformed':>11}  input")
    for r in results:
        note = " (done before)" if r.skipped else ""
        say(f"{r.conversations:>14,}{r.tokens:>12,}{r.trained_tokens:>12,}{len(r.malformed):>11,}  {r.input}{note}")
        for bad in r.malformed[:20]:
            say(f"{'':>49}row {bad['row']}: {bad['problem']}")
    total = {k: sum(getattr(r, k) for r in results) for k in ("conversations", "tokens", "trained_tokens")}
    malformed = sum(len(r.malformed) for r in results)
    over = sum(r.over_seq_length for r in results)
    split = sum(r.split_turns for r in results)
    folded = sum(r.folded_system for r in results)
    share = total["trained_tokens"] / max(total["tokens"], 1)
    say(f"{total['conversations']:,} conversations, {total['tokens']:,} tokens, {total['trained_tokens']:,} "
        f"trained ({share:.1%}), {malformed:,} malformed rows left out"
        + (f", {over:,} longer than {seq_length} tokens (truncated in training)" if seq_length else "")
        + (f", {split:,} split one sample per assistant turn (the template rewrites earlier turns)" if split else "")
        + (f", {folded:,} with the system message folded into the first user turn (the template has no system "
           "role)" if folded else ""))
    out, tok = os.path.abspath(output), os.path.abspath(tokenizer)
    say(f"next: megalaunch submit sft-tiny --set data.mock=false --set 'data.blend=[{{path: {out}}}]' "
        f"--set data.tokenizer_type=HuggingFaceTokenizer --set data.tokenizer_model={shlex.quote(tok)} "
        "--set checkpoint.load=CONVERTED (docs/finetuning.md)")
