"""DPO's reference: the frozen starting model's log-probabilities of every token of the training data,
computed once by a scoring phase in the run's first segment (the model Megatron just loaded at iteration 0
IS the starting model), stored in RUN/scores/reference (runtime/scoring/store.py), and checked against the
model a run starts from (docs/post_training.md, "The reference").

The phase is sharded over data-parallel ranks: each round, every data-parallel rank scores 2 x `micro_batch_size`
documents (a training micro-batch's sequences) (its tensor-parallel ranks together), the rows are gathered and rank 0 appends them in order. A stop
(signal, trigger) during the phase is decided collectively between rounds like one between iterations: the
rows scored so far are flushed and the next segment continues from documents_done.
Test hook: MEGALAUNCH_TEST_SCORE_ROUND_S=S makes every round S seconds longer (a stop that arrives mid-phase)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megalaunch.runtime.flows.flow import FlowContext
from megalaunch.runtime.rank.failures import ConfigFailure
from megalaunch.runtime.scoring.store import (
    Documents,
    ScoreWriter,
    data_entry,
    fingerprint,
    mismatch,
    prefix_name,
    read_meta,
)

ROUND_DELAY_ENV = "MEGALAUNCH_TEST_SCORE_ROUND_S"
FLUSH_EVERY_S = 30.0  # rows are made durable (and documents_done advanced) at least this often
FIX = "delete RUN/scores/reference to score again with the starting model, or start the run from the model it was scored with"


def store_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "scores" / "reference"


def model_identity(ctx: FlowContext) -> dict[str, str]:
    """The starting model's fingerprint: its checkpoint's, or the random initialisation's seed."""
    if ctx.start:
        return {"fingerprint": fingerprint(ctx.start), "source": str(ctx.start)}
    return {"fingerprint": f"random-init:seed={ctx.seed}", "source": f"random initialisation (seed {ctx.seed})"}


def verdict_on_rank_zero(ctx: FlowContext, check: Any) -> None:
    """Run `check()` (-> a reason or None) on rank 0; every rank raises the same ConfigFailure on a reason."""
    reason = check() if ctx.is_zero else None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        box = [reason]
        dist.broadcast_object_list(box, 0)
        reason = box[0]
    if reason:
        raise ConfigFailure(f"the DPO reference in RUN/scores/reference does not match this run: {reason}", fix=FIX)


def stored_mismatch(ctx: FlowContext, *, need_complete: bool) -> str | None:
    """Why the stored reference is not this run's (None: it is, as far as it goes; or there is none yet)."""
    meta = read_meta(store_dir(ctx.run_dir))
    if meta is None:
        return "it is missing (the run is past its first iteration)" if need_complete else None
    model = model_identity(ctx)
    why = mismatch(meta, kind="logprobs", top_k=None, model=model, data={prefix_name(p): data_entry(p) for p in ctx.prefixes})
    if why is not None:
        return why.reason
    if need_complete and not meta.get("complete"):
        return "it is incomplete (the run is past its first iteration)"
    return None


def score_reference(model: Any, ctx: FlowContext) -> None:
    """Score every document of the training data with `model` (frozen, eval mode) into RUN/scores/reference,
    continuing where a stopped segment left it."""
    writer = ScoreWriter(store_dir(ctx.run_dir), kind="logprobs", prefixes=ctx.prefixes,
                         model=model_identity(ctx)) if ctx.is_zero else None
    per_rank = max(1, 2 * ctx.micro_batch_size)  # a training micro-batch's sequences (pairs x 2), forward only
    began, last_flush, tokens = time.monotonic(), time.monotonic(), 0
    was_training = model.training
    model.eval()
    try:
        for prefix in ctx.prefixes:
            name, docs = prefix_name(prefix), Documents(prefix)
            start = _broadcast_int(writer.done(name) if writer is not None else 0)
            if start < len(docs):
                ctx.log(f"reference scoring: {name}, documents {start}..{len(docs)}")
            for done, scored in score_chunks(model, docs, start, per_rank=per_rank, seq=ctx.seq_length):
                tokens += sum(len(r) - 1 for r in scored)
                if writer is not None:
                    writer.append(name, scored)
                time.sleep(float(os.environ.get(ROUND_DELAY_ENV) or 0))
                ctx.beat(f"reference scoring {done}/{len(docs)}")
                decision = ctx.decide()
                if writer is not None and (decision or time.monotonic() - last_flush >= FLUSH_EVERY_S):
                    writer.flush(seconds=time.monotonic() - began, tokens=tokens)
                    began, last_flush, tokens = time.monotonic(), time.monotonic(), 0
                ctx.act(decision)  # a stop leaves here, its rows durable
        if writer is not None:
            writer.flush(seconds=time.monotonic() - began, tokens=tokens, complete=True)
            writer.close()
        _broadcast_int(1)  # every rank reads the store after rank 0 has written it whole
    finally:
        model.train(was_training)


def score_chunks(model: Any, docs: Documents, done: int, *, per_rank: int,
                 seq: int) -> Iterator[tuple[int, list[Any]]]:
    """Every rank (a collective): score documents `done`.. of `docs` with `model` (frozen by the caller: eval
    mode), `per_rank` documents per data-parallel rank and chunk (tensor-parallel ranks together); yields
    (documents done, the chunk's store rows: `_row`), the rows gathered on every rank."""
    import torch
    from megatron.core import mpu

    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    while done < len(docs):
        chunk = list(range(done, min(len(docs), done + dp * per_rank)))
        mine = chunk[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        with torch.no_grad():
            rows = _score(model, docs, mine, per_rank, seq)
        gathered = _gather(rows)
        done = chunk[-1] + 1
        yield done, [_row(gathered[i], docs.lengths[d], seq) for i, d in enumerate(chunk)]


def _broadcast_int(value: int) -> int:
    from megalaunch.runtime.rank.collectives import broadcast_from_zero

    return int(broadcast_from_zero(value))


def _score(model: Any, docs: Documents, chosen: list[int], rows: int, seq: int) -> Any:
    """log p(token j+1 | <= j) of `chosen` documents as a [rows, seq] float32 tensor (missing rows: zeros)."""
    import torch

    device = next(model.parameters()).device
    tokens = np.zeros((rows, seq + 1), dtype=np.int64)
    for i, d in enumerate(chosen):
        ids = np.asarray(docs.get(d)[0][: seq + 1], dtype=np.int64)
        tokens[i, : len(ids)] = ids
    t = torch.from_numpy(tokens).to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(rows, seq)
    per_token = model(t[:, :-1].contiguous(), positions, None, labels=t[:, 1:].contiguous())
    return (-per_token.float()).contiguous()


def _gather(rows: Any) -> Any:
    """Every data-parallel rank's rows, in rank order, as one [dp x rows, seq] CPU array."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    if mpu.get_data_parallel_world_size() == 1:
        return rows.cpu().numpy()
    parts = [torch.empty_like(rows) for _ in range(mpu.get_data_parallel_world_size())]
    dist.all_gather(parts, rows, group=mpu.get_data_parallel_group())
    return torch.cat(parts).cpu().numpy()


def _row(scores: np.ndarray, length: int, seq: int) -> np.ndarray:
    """The store's rows of one document: row 0 unused, row j = log p(token j | < j) for the tokens a sample holds."""
    n = min(int(length), seq + 1)
    out = np.zeros(n, dtype=np.float32)
    out[1:] = scores[: n - 1]
    return out


def reference_for_batch(reader: Any, names: dict[int, str], documents: Any, sources: Any, seq: int) -> np.ndarray:
    """[rows, seq] float32: the stored log-probability of each label (label j of a sample = token j + 1 of its
    document), aligned with the batch's labels; zeros for padding rows (document -1)."""
    out = np.zeros((len(documents), seq), dtype=np.float32)
    for i, (d, s) in enumerate(zip(documents.tolist(), sources.tolist(), strict=True)):
        if d < 0:
            continue
        stored = reader.get(names[int(s)], int(d))
        n = min(len(stored) - 1, seq)
        out[i, :n] = stored[1:n + 1]
    return out
