"""`submit --data FILES` for DPO / IPO (post_training.method dpo | ipo): every row of every chat file is read
at submit, on the login node with the standard library (tokenization/chat/rows.py), and must be a preference
pair: a prompt (or context messages) with a non-empty `chosen` and `rejected` answer that differ. The first
bad row is named (file and 1-based row) in one line and nothing is submitted; the chain's first stage checks
every row again when it tokenizes them. Parquet files are read here when pyarrow is installed (else only in
the job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megalaunch.errors import ConfigError
from megalaunch.tokenization.chat.rows import read_rows

PAIR = '{"prompt": "...", "chosen": "...", "rejected": "..."} (or "messages": [...] as the context)'


def check_preference_files(files: list[Path], method: str) -> int:
    """The number of pairs in `files`; a ConfigError naming the first bad row."""
    pairs = 0
    parquet = importlib.util.find_spec("pyarrow") is not None
    for path in files:
        if path.suffix == ".parquet" and not parquet:
            continue
        rows = 0
        for row in read_rows(path):
            rows += 1
            problem = row.problem or (None if row.rejected is not None else "not a preference pair (no 'chosen' / 'rejected')")
            if problem is not None:
                raise ConfigError(f"{path} row {row.number}: {problem}; post_training.method {method} trains on "
                                  "preference pairs", field="--data", valid=f"rows like {PAIR}",
                                  fix="fix or remove that row (megalaunch data sft FILE --tokenizer MODEL_DIR --output "
                                      "/tmp/check names every bad one)")
        if rows == 0:
            raise ConfigError(f"{path} holds no rows", field="--data", valid=f"rows like {PAIR}",
                              fix="remove the empty file, or fill it")
        pairs += rows
    return pairs
