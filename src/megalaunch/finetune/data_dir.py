"""`--data DIR` at submit: prepared SFT data (the output of `megalaunch data sft`: `.bin/.idx` with a `.mask`
each) goes straight into the blend; chat files (`.jsonl`, `.json`, `.parquet`, or a folder of them) become
`data.chat_files`, which the chain's first stage renders and tokenizes with the run's own tokenizer and chat
template (launcher/chain/first_stage.py: that needs transformers, which a login node lacks, and minutes
of CPU for a real set). At submit only what is cheap is checked: the folder is not empty, and the first
row of each JSON-lines file is a conversation (the stage checks every row and names the bad ones)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megalaunch.data.index import find_prefixes
from megalaunch.errors import ConfigError
from megalaunch.runtime.flows.chat_format import MARKER_SUFFIX, MASK_SUFFIX
from megalaunch.tokenization.chat.rows import FORMATS, SUFFIXES, read_rows

_WHAT = "a folder of chat JSONL files (rows like {\"messages\": [...]}) or the output of `megalaunch data sft`"


def chat_files(path: Path) -> list[Path]:
    """The conversation files at `path` (a file, or a folder searched recursively; data sft's markers left out)."""
    if path.is_file():
        return [path] if path.suffix in SUFFIXES else []
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                  and not p.name.endswith(MARKER_SUFFIX) and not any(part.startswith(".") for part in p.parts))


def check_first_rows(files: list[Path], data: str) -> None:
    """The first row of each JSON-lines file is a conversation; an empty file has none (parquet: the stage)."""
    for path in files:
        if path.suffix == ".parquet":
            continue
        row = next(iter(read_rows(path)), None)
        if row is None:
            raise ConfigError(f"{path} holds no rows", field="--data", valid=f"rows like {FORMATS}",
                              fix=f"remove the empty file from {data}, or fill it")
        if row.problem is not None:
            raise ConfigError(f"{path} row {row.number}: {row.problem}", field="--data", valid=f"rows like {FORMATS}",
                              fix="write one conversation per line ({\"messages\": [{\"role\": ..., \"content\": "
                                  "...}, ...]}), or check it with megalaunch data sft FILE --tokenizer MODEL_DIR "
                                  "--output /tmp/check")


def data_layer(data: str) -> dict[str, Any]:
    """What `--data DATA` sets under `--set`: the blend of prepared SFT data, or chat files to tokenize."""
    path = Path(data).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"{data} does not exist", field="--data", valid=_WHAT, fix="fix the path")
    prefixes = find_prefixes(path) if path.is_dir() else []
    if prefixes:
        unmasked = [p for p in prefixes if not os.path.isfile(p + MASK_SUFFIX)]
        if unmasked:
            raise ConfigError(f"{unmasked[0]} has no loss mask ({MASK_SUFFIX}): token data for pre-training, not "
                              "SFT data", field="--data", valid=_WHAT,
                              fix="point --data at the chat files or at `megalaunch data sft`'s output")
        return {"data": {"mock": False, "format": "chat", "blend": [{"path": str(path)}], "blend_file": None}}
    files = chat_files(path)
    if not files:
        raise ConfigError(f"{data} holds no chat files ({', '.join(SUFFIXES)}) and no prepared SFT data "
                          "(.bin/.idx/.mask)", field="--data", valid=_WHAT,
                          fix="put the conversations (one JSON object a line) in it, or name another folder")
    check_first_rows(files, data)
    return {"data": {"mock": False, "format": "chat", "chat_files": str(path), "blend": [], "blend_file": None}}
