"""The on-disk format of GRPO's rollouts in a run, shared by their tokenizer (`megalaunch data rollouts`,
tokenization/rollout_build.py), the feed that brings each round in (runtime/flows/rollout_feed.py) and the
dataset that reads them (runtime/flows/rollout_data.py).

`post_training.rollouts` is one file (one round) or a directory of rounds `round-000001.jsonl` (or
`.parquet`), `round-000002.jsonl`, ... that a generator outside writes while the chain trains. A round counts
once its file is there under that name: the generator writes it under another name (`round-000002.jsonl.tmp`,
or a dot-file) and renames it, which is atomic on one file system. Each round, tokenized, is chat data
`RUN/rollouts/<stem>.bin/.idx/.mask` with side files (raw little-endian float32):
`.adv` (advantage per conversation), `.reward` (reward per conversation), `.oldlogp` (per token, only when
the rollouts gave old log-probabilities; NaN where none), and `<stem>.done.json`, its marker, written last."""

from __future__ import annotations

import re
from pathlib import Path

ADV_SUFFIX = ".adv"
REWARD_SUFFIX = ".reward"
OLD_LOGP_SUFFIX = ".oldlogp"
ROLLOUTS_DIR = "rollouts"  # RUN/rollouts: the tokenized rounds, record.jsonl, gates/
RECORD = "record.jsonl"  # one line per round brought in: its file, sha256, samples and iterations
ROUND_RE = re.compile(r"^round-(\d{6})\.(jsonl|parquet)$")
ROUND_SUFFIXES = (".jsonl", ".parquet")


def round_name(k: int) -> str:
    return f"round-{k:06d}"


def round_source(source: Path, k: int) -> Path | None:
    """The file of round k (1-based) where it is complete now; a single file is round 1 and the only one."""
    if source.is_file():
        return source if k == 1 else None
    for suffix in ROUND_SUFFIXES:
        path = source / f"{round_name(k)}{suffix}"
        if path.is_file():
            return path
    return None


def round_stem(source: Path, k: int) -> str:
    """The name of round k's tokenized data under RUN/rollouts."""
    return round_name(k)
