"""The stored scores in the disk budget (issue 51): what RUN/scores/** will hold, added to the checkpoints'
peak that submit checks against the run root's free space and quota (config/storage.py) and that `status`
shows. Per token of the training data: DPO's / IPO's reference 4 bytes (a float32 log-probability), GRPO's
reference for its KL 4 bytes when kl_coeff > 0 and its old policy's 4 bytes with old_logprobs stage
(RUN/scores/old), a distillation teacher's top-k 8 bytes per kept entry (int32
id + float32 log-probability). The tokens are the prepared data's (read from the .idx files) or, for chat
files the chain's first stage tokenizes, estimated from their size (a token per 3 bytes of JSON, erring high).
GRPO's rounds arrive while the chain trains: their tokenized data (RUN/rollouts: tokens, loss mask, old
log-probabilities) and per-round reference and old scores are bounded by the samples trained, train_iters x global batch
x (seq_length + 1) tokens."""

from __future__ import annotations

import os
from pathlib import Path

from megalaunch.config.schema import Recipe

BYTES_PER_TOKEN_OF_TEXT = 3.0  # JSON rows -> tokens, an estimate that errs towards more tokens
ROLLOUT_BYTES_PER_TOKEN = 4 + 1 + 4  # RUN/rollouts: token (int32 at most), loss-mask byte, old log-probability


def score_bytes_per_token(recipe: Recipe) -> float:
    pt = recipe.post_training
    if pt.method in ("dpo", "ipo"):
        return 4.0
    if pt.method == "grpo":  # the reference for the KL; the old policy's, scored at each round's start (stage)
        return 4.0 * (pt.kl_coeff > 0) + 4.0 * (pt.old_logprobs == "stage")
    if pt.method == "distill":  # stored only where the teacher runs in the stage (auto: as submit decides)
        from megalaunch.config.training.teacher_plan import resolved_teacher_mode

        return 8.0 * pt.teacher_top_k if resolved_teacher_mode(recipe) == "stage" else 0.0
    return 0.0


def data_tokens(recipe: Recipe, blend_text: str | None) -> tuple[int, bool]:
    """(tokens of the training data, estimated?) for the stored scores; (0, False) when unknown (mock data)."""
    from megalaunch.data.index import read_index_header

    if blend_text:
        prefixes = blend_text.split()[1::2]
        return sum(read_index_header(p).token_count for p in prefixes), False
    if recipe.data.chat_files:
        root = Path(os.path.expanduser(recipe.data.chat_files))
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        return int(sum(p.stat().st_size for p in files) / BYTES_PER_TOKEN_OF_TEXT), True
    return 0, False


def scores_bytes(recipe: Recipe, blend_text: str | None) -> float:
    """Bytes RUN/scores/** will hold (0: the run stores none)."""
    per = score_bytes_per_token(recipe)
    if recipe.post_training.method == "grpo":
        t = recipe.training
        return (per + ROLLOUT_BYTES_PER_TOKEN) * t.train_iters * t.global_batch_size * (recipe.model.seq_length + 1)
    return per * data_tokens(recipe, blend_text)[0] if per else 0.0
