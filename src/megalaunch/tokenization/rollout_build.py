"""A rollout file -> the chat data the GRPO flow reads (runtime/flows/rollout_data.py).

Each completion is one conversation, rendered with the tokenizer's chat template (tokenization/chat/render.py):
the prompt as its turn(s), the completion as the assistant's answer with the loss mask on it (and on what
the template closes the turn with). Written as `megalaunch data sft` writes chat data (`P.bin/.idx/.mask`,
runtime/flows/chat_format.py), in the file's group order, plus side files, raw little-endian float32:

  P.adv      [conversations]  the group-normalised advantage (data/rollouts.py: TRL's formula)
  P.reward   [conversations]  the completion's reward (the flow's `reward` metric)
  P.oldlogp  [tokens]         only when the file gives old log-probabilities: aligned with P's tokens, row j
                              = log p_old(token j | tokens < j), the score store's convention
                              (runtime/scoring/store.py); NaN where none is given (the prompt, and template
                              tokens after the generated ones, e.g. a newline the template adds after its
                              end-of-turn token): there the old policy is the current one

and the marker `P.done.json` (counts, the source's sha256, the tokenizer's digest) written last. The given
token ids must be the first answer tokens of the template's tokenization, else the row is refused by number.
A file with a bad row writes nothing (RolloutError naming the rows)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megalaunch.data.rollouts import (
    BadRow,
    Completion,
    Group,
    RolloutError,
    read_rollouts,
    read_round_bytes,
    rollout_error,
)
from megalaunch.runtime.flows.chat_format import MARKER_SUFFIX, MASK_SUFFIX, tokenizer_digest
from megalaunch.runtime.flows.rollout_format import ADV_SUFFIX, OLD_LOGP_SUFFIX, REWARD_SUFFIX
from megalaunch.tokenization.chat.render import ChatRenderer, Encoded, RenderError


@dataclass
class RolloutStats:
    source: str
    source_sha256: str
    prefix: str
    groups: int = 0
    conversations: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    longest: int = 0
    over_seq_length: int = 0
    reward_mean: float = 0.0
    old_logprobs: bool = False  # P.oldlogp was written
    tokenizer_sha256: str | None = None


def read_marker(prefix: Path) -> RolloutStats | None:
    try:
        return RolloutStats(**json.loads(Path(str(prefix) + MARKER_SUFFIX).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def tokenize_rollouts(path: Path, prefix: Path, renderer: ChatRenderer, *, seq_length: int | None = None,
                      multiple_of: int | None = None) -> RolloutStats:
    """`path` -> prefix.* (see the module docstring); RolloutError naming the bad rows, nothing written.
    `multiple_of`: the completions must be a multiple of it (a round fills whole iterations of that global batch
    size), checked before anything is written, so that a marker always means a usable round."""
    import numpy

    from megalaunch.data.writer import IndexedWriter, token_dtype_for_vocab

    data = read_round_bytes(path)  # read once: the rows trained on are the bytes recorded (a swap changes neither)
    digest = hashlib.sha256(data).hexdigest()
    groups = read_rollouts(path, data)
    n = sum(len(g.completions) for g in groups)
    if multiple_of and n % multiple_of:
        raise RolloutError(f"{path} holds {n} completions, not a multiple of the global batch size {multiple_of}: "
                           f"each round fills whole iterations; write rounds of a multiple of {multiple_of} completions")
    encoded, olds, bad = _encode_all(groups, renderer)
    if bad:
        raise rollout_error(path, sorted(bad))
    stats = RolloutStats(source=str(path), source_sha256=digest, prefix=str(prefix), groups=len(groups),
                         tokenizer_sha256=tokenizer_digest(renderer.source))
    Path(str(prefix) + MARKER_SUFFIX).unlink(missing_ok=True)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype_for_vocab(renderer.vocab_size))
    try:
        for enc in encoded:
            writer.add_batch([enc.tokens])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    completions = [c for g in groups for c in g.completions]
    advantages = [a for g in groups for a in g.advantages()]
    _write(prefix, MASK_SUFFIX, b"".join(bytes(e.mask) for e in encoded))
    _write(prefix, ADV_SUFFIX, numpy.asarray(advantages, dtype="<f4").tobytes())
    _write(prefix, REWARD_SUFFIX, numpy.asarray([c.reward for c in completions], dtype="<f4").tobytes())
    if any(o is not None for o in olds):
        rows = [o if o is not None else numpy.full(len(e.tokens), numpy.nan, "<f4")
                for o, e in zip(olds, encoded, strict=True)]
        _write(prefix, OLD_LOGP_SUFFIX, numpy.concatenate(rows).astype("<f4").tobytes())
        stats.old_logprobs = True
    lengths = [len(e.tokens) for e in encoded]
    stats.conversations, stats.tokens, stats.longest = len(encoded), sum(lengths), max(lengths)
    stats.trained_tokens = sum(sum(e.mask) for e in encoded)
    stats.over_seq_length = sum(n > seq_length + 1 for n in lengths) if seq_length else 0
    stats.reward_mean = sum(c.reward for c in completions) / len(completions)
    _write(prefix, MARKER_SUFFIX, (json.dumps(asdict(stats), indent=1) + "\n").encode())
    return stats


def _write(prefix: Path, suffix: str, data: bytes) -> None:
    tmp = Path(f"{prefix}{suffix}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, f"{prefix}{suffix}")


def _encode_all(groups: list[Group], renderer: ChatRenderer) -> tuple[list[Encoded], list[Any], list[tuple[int, str]]]:
    encoded: list[Encoded] = []
    olds: list[Any] = []
    bad: list[tuple[int, str]] = []
    for g in groups:
        for c in g.completions:
            try:
                enc = renderer.encode(g.prompt + c.answer, start=len(g.prompt))
                if not any(enc.mask):
                    raise BadRow("the completion renders to no answer token")
                encoded.append(enc)
                olds.append(_old_row(enc, c))
            except (RenderError, BadRow) as e:
                bad.append((c.row, str(e)))
    return encoded, olds, bad


def _old_row(enc: Encoded, c: Completion) -> Any:
    """The completion's old log-probabilities on the conversation's token rows (NaN elsewhere), or None."""
    import numpy

    if c.token_ids is None or c.old_logprobs is None:
        return None
    start = enc.mask.index(1)
    answer = enc.tokens[start:start + sum(enc.mask)]
    n = len(c.token_ids)
    if answer[:n] != c.token_ids:
        at = next((i for i, (a, b) in enumerate(zip(answer, c.token_ids, strict=False)) if a != b), min(len(answer), n))
        raise BadRow(f"its token ids differ from the chat template's tokenization of the completion at answer token "
                     f"{at} ({len(c.token_ids)} given, {len(answer)} in the template's answer); the old "
                     "log-probabilities must be of the tokens trained on (generate with this tokenizer and template)")
    row = numpy.full(len(enc.tokens), numpy.nan, dtype="<f4")
    row[start:start + n] = c.old_logprobs
    return row
