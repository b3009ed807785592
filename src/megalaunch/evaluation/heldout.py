"""Held-out tokens: the first N sequences of the validation split of the run's frozen blend (or of
the recipe's eval.heldout_blend), the same at every milestone, so perplexities compare.

The validation split is Megatron's: `data.split` divides each dataset's documents in order
(train first, then validation, then test; megatron.core.datasets.utils.get_split_indices' rounding),
so no document the model trained on is held out. Prefixes are taken in the blend's (sorted) order,
their validation documents concatenated and cut into sequences of seq_length + 1 tokens (the model
predicts the last seq_length of them)."""

from __future__ import annotations

import os
from typing import Any

from megalaunch.errors import PreflightError


def split_bounds(split: str, n_docs: int) -> list[int]:
    """Document boundaries [0, train_end, valid_end, test_end] as Megatron cuts them: cumulative shares
    of the normalised split, each boundary `int(round(share * n))`
    (megatron/core/datasets/blended_megatron_dataset_builder.py, 0.19.2)."""
    weights = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds, cumulative = [0], 0.0
    for w in weights:
        cumulative += w / total
        bounds.append(int(round(cumulative * float(n_docs))))  # noqa: RUF046 (Megatron's own expression)
    return bounds


def heldout_sequences(prefixes: list[str], *, split: str | None, count: int, seq_length: int) -> list[list[int]]:
    """`count` sequences of seq_length + 1 tokens; `split` None: every document of the prefixes."""
    import numpy as np

    from megalaunch.data.index import read_documents

    need = count * (seq_length + 1)
    pieces: list[Any] = []
    have = 0
    for prefix in prefixes:
        docs = read_documents(prefix)
        lo, hi = (0, len(docs)) if split is None else split_bounds(split, len(docs))[1:3]
        for doc in docs[lo:hi]:
            pieces.append(np.asarray(doc, dtype=np.int64))
            have += len(doc)
            if have >= need:
                break
        if have >= need:
            break
    if have < need:
        where = "eval.heldout_blend" if split is None else f"the validation split ({split}) of the blend"
        raise PreflightError(f"{where} holds {have} tokens; {count} sequences of {seq_length + 1} need {need}",
                             field="eval.heldout_sequences", valid=f"at most {have // (seq_length + 1)}",
                             fix="lower eval.heldout_sequences, or give more validation data (data.split)")
    flat = np.concatenate(pieces)[:need].reshape(count, seq_length + 1)
    return flat.tolist()


def blend_prefixes(data_blend_text: str) -> list[str]:
    """Prefixes of a frozen data_blend.txt ("weight prefix" pairs, Megatron's --data-args-path)."""
    from megalaunch.data.blend import Blend

    return [os.path.expanduser(prefix) for prefix, _ in Blend.from_text(data_blend_text).prefixes]


def perplexity(model: Any, sequences: list[list[int]], *, batch_size: int, device: Any) -> dict[str, float]:
    """Mean next-token negative log-likelihood over every predicted token, and its exp."""
    import math

    import torch
    import torch.nn.functional as F

    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(sequences), batch_size):
            batch = torch.tensor(sequences[i:i + batch_size], dtype=torch.long, device=device)
            logits = model(batch[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
            tokens += batch[:, 1:].numel()
    mean = total / tokens
    return {"nll": mean, "ppl": math.exp(mean), "tokens": tokens, "sequences": len(sequences)}
