"""The on-disk format of chat data, shared by its writer (`megalaunch data sft`, tokenization/chat/build.py),
preflight and its reader in the job (runtime/flows/chat_dataset.py): a Megatron `.bin/.idx` token dataset,
one conversation per document, and beside it `<prefix>.mask`, one byte per token (1: an assistant's
token, trained on; 0: context), and `<prefix>.done.json`, the completion marker with the file's counts
and the sha256 of the tokenizer.json it was tokenized with."""

from __future__ import annotations

import hashlib
from pathlib import Path

MASK_SUFFIX = ".mask"
MARKER_SUFFIX = ".done.json"


def tokenizer_digest(ref: str | Path) -> str | None:
    """sha256 of the tokenizer.json of a tokenizer file or directory (None: it has none)."""
    path = Path(ref).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
