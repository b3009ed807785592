"""Preflight of `data.format: chat` (docs/finetuning.md): every prefix of the blend is the output of
`megalaunch data sft` (its loss mask beside it), tokenized with the run's own tokenizer, and that
tokenizer has a chat template (else the fine-tuned model, converted back, could not be chatted with)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megalaunch.config.tokenizer import TokenizerSpec
from megalaunch.errors import PreflightError
from megalaunch.runtime.flows.chat_format import MARKER_SUFFIX, MASK_SUFFIX, tokenizer_digest

_MAKE = "megalaunch data sft CONVERSATIONS --tokenizer MODEL_DIR --output DIR"


def check_chat_data(blend: Any | None, spec: TokenizerSpec | None) -> None:
    """`blend` None: chat files the chain's first stage tokenizes (data.chat_files); the template still counts."""
    prefixes = blend.prefixes if blend is not None else ()
    for prefix, _ in prefixes:
        if not os.path.isfile(prefix + MASK_SUFFIX):
            raise PreflightError(f"{prefix} has no loss mask ({prefix}{MASK_SUFFIX})", field="data.blend",
                                 valid="the output folder of `megalaunch data sft` (data.format: chat)",
                                 fix=f"{_MAKE}, or --set data.format=tokens for pre-training data")
    if spec is None:
        return
    if not (spec.config.get("chat_template") or "chat_template.jinja" in spec.files_from):
        raise PreflightError(f"the tokenizer {spec.source} has no chat template: the fine-tuned model could not "
                             "be chatted with", field="data.tokenizer_model",
                             valid="the model's Hugging Face directory (the one given to `data sft --tokenizer`)",
                             fix="--set data.tokenizer_model=MODEL_DIR")
    run = tokenizer_digest(spec.files_from["tokenizer.json"]) if "tokenizer.json" in spec.files_from else None
    for prefix, _ in prefixes:
        made = _marker_digest(prefix)
        if run and made and made != run:
            raise PreflightError(f"{prefix} was tokenized with another tokenizer than {spec.source}",
                                 field="data.tokenizer_model", valid="the tokenizer given to `data sft --tokenizer`",
                                 fix=f"--set data.tokenizer_model=THAT_DIR, or tokenize again: {_MAKE}")


def _marker_digest(prefix: str) -> str | None:
    try:
        data = json.loads(Path(prefix + MARKER_SUFFIX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = data.get("tokenizer_sha256") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) else None
