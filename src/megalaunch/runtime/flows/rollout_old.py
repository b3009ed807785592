"""GRPO's old log-probabilities computed by a stage (`post_training.old_logprobs: stage`, the default): at the
step boundary where a round is brought in, before its first iteration, every rank scores the round's documents
with the current policy, frozen (eval mode, no graph), into the score store RUN/scores/old/<round>/ (kind
"logprobs", runtime/scoring/store.py): the policy the round starts from is the old policy of all its iterations,
so the clipped ratio acts as the policy moves within the round (verl's actor recomputes them likewise).

The scoring is DPO's reference scoring (runtime/flows/reference.py `score_chunks`: data-parallel shards, the
tensor-parallel ranks together); rank 0 writes, every rank waits on the store's completion (a broadcast). The
store's model is "the policy at iteration i" (i: the boundary's iteration), so a store continues only at the
same boundary: a stop signal during the scoring makes the segment save at that boundary (the gate's
`interrupted()`, decided collectively after each chunk), and the next segment, loaded from that checkpoint (the
model that began the scoring), continues from documents_done. A round's later iterations (a segment resumed
mid-round) read the store written at its start: their old log-probabilities are an uninterrupted run's.
Where the rollouts give old log-probabilities for every answer token, the round is not scored. Test hook:
MEGALAUNCH_TEST_SCORE_ROUND_S=S makes every chunk S seconds longer (a stop that arrives mid-scoring)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy

from megalaunch.runtime.flows.rollout_feed import INTERRUPTED, RolloutFeed
from megalaunch.runtime.flows.rollout_format import OLD_LOGP_SUFFIX
from megalaunch.runtime.rank.failures import ConfigFailure

OLD_DIR = "scores/old"  # RUN/scores/old/<round>/


def old_dir(run_dir: Path, stem: str) -> Path:
    return Path(run_dir) / OLD_DIR / stem


def old_stage(settings: dict[str, Any] | None) -> bool:
    """The post_training section asks for old log-probabilities from the stage (the default)."""
    return (settings or {}).get("old_logprobs", "stage") == "stage"


def needs_scoring(prefix: Path) -> bool:
    """Some answer token of the round has no old log-probability from the rollouts."""
    given = Path(str(prefix) + OLD_LOGP_SUFFIX)
    if not given.is_file():
        return True
    from megalaunch.runtime.flows.chat_dataset import ChatDocuments

    masks = ChatDocuments(str(prefix)).masks
    old = numpy.memmap(given, dtype="<f4", mode="r")
    return bool(numpy.isnan(old[numpy.asarray(masks) > 0]).any())


def policy_at(iteration: int) -> dict[str, str]:
    """The store's model: the policy at the boundary after `iteration` (a store continues only for the same)."""
    return {"fingerprint": f"policy:iteration={iteration}", "source": f"the policy at iteration {iteration}"}


class OldScorer:
    """Every rank: makes sure the round of the next iteration has its old log-probabilities (module docstring)."""

    def __init__(self, model: Any, feed: RolloutFeed, *, micro_batch_size: int,
                 beat: Callable[[str], None] | None = None) -> None:
        self.model, self.feed, self.per_rank, self.beat = model, feed, max(1, micro_batch_size), beat
        self.ready: set[int] = set()  # rounds whose store is complete (or not needed)

    def ensure(self, iteration: int, interrupted: Callable[[], bool]) -> str | None:
        """At the boundary before `iteration`, its round brought in: None when its old log-probabilities are
        stored (scored now if not yet), INTERRUPTED when the stop signal came during the scoring."""
        from megalaunch.runtime.rank.collectives import broadcast_from_zero

        c = self.feed.c
        if iteration > c.train_iters:
            return None
        where = self.feed.locate((iteration - 1) * c.global_batch)
        assert where is not None, "the gate brings the round in first"
        k, row = where[0] + 1, where[1]
        if k in self.ready:
            return None
        prefix, directory = self.feed.prefix(k), old_dir(c.run_dir, self.feed.prefix(k).name)
        start = iteration - 1 - row // c.global_batch  # the boundary before the round's first iteration
        state = broadcast_from_zero(self._state(prefix, directory, start) if self.feed.is_zero else 0)
        if state == 1:
            self.ready.add(k)
            return None
        if row != 0:
            raise ConfigFailure(f"rollout round {k} has no old log-probabilities in {directory} and the policy has "
                                f"moved since its first iteration (resumed at iteration {iteration})",
                                fix="resume from the checkpoint before the round's first iteration, or --set "
                                    "post_training.old_logprobs=current")
        answer = self._score(k, iteration - 1, prefix, directory, interrupted)
        if answer is None:
            self.ready.add(k)
        return answer

    @staticmethod
    def _state(prefix: Path, directory: Path, start: int) -> int:
        """Rank 0: 1 when the round's store is complete for the policy at `start` (or none is needed), 2 when it
        is to be scored."""
        from megalaunch.runtime.scoring.store import read_meta

        meta = read_meta(directory) or {}
        if meta.get("complete") and meta.get("model", {}).get("fingerprint") == policy_at(start)["fingerprint"]:
            return 1
        return 2 if needs_scoring(prefix) else 1

    def _score(self, k: int, at: int, prefix: Path, directory: Path, interrupted: Callable[[], bool]) -> str | None:
        from megalaunch.runtime.flows.reference import ROUND_DELAY_ENV, score_chunks
        from megalaunch.runtime.rank.collectives import all_reduce_max, broadcast_from_zero
        from megalaunch.runtime.scoring.store import Documents, ScoreWriter, prefix_name

        writer = ScoreWriter(directory, kind="logprobs", prefixes=[str(prefix)], model=policy_at(at)) \
            if self.feed.is_zero else None
        name, docs = prefix_name(prefix), Documents(prefix)
        done = start = broadcast_from_zero(writer.done(name) if writer is not None else 0)
        self.feed.log(f"rollouts: round {k}: old log-probabilities with the policy at iteration {at}, "
                      f"documents {start}..{len(docs)}")
        began, tokens, stopped = time.monotonic(), 0, False
        was_training = self.model.training
        self.model.eval()
        try:
            for done, scored in score_chunks(self.model, docs, start, per_rank=self.per_rank,
                                             seq=int(self.feed.c.seq_length or 0)):
                tokens += sum(len(r) - 1 for r in scored)
                if writer is not None:
                    writer.append(name, scored)
                time.sleep(float(os.environ.get(ROUND_DELAY_ENV) or 0))  # test hook: a stop during the scoring
                if self.beat is not None:
                    self.beat(f"old log-probabilities of round {k}: {done}/{len(docs)}")
                if all_reduce_max(int(interrupted())):
                    stopped = True
                    break
        finally:
            self.model.train(was_training)
        seconds = time.monotonic() - began
        if writer is not None:
            writer.flush(seconds=seconds, tokens=tokens, complete=not stopped)
            writer.close()
        broadcast_from_zero(1)  # every rank reads the store after rank 0 has written it
        if stopped:
            self.feed.log(f"rollouts: round {k}: the old log-probabilities give way to the stop signal at {done}")
            return INTERRUPTED
        if self.feed.ledger is not None and self.feed.is_zero:
            self.feed.ledger("old_logprobs_scored", round=k, iteration=at, documents=len(docs), tokens=tokens,
                             seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 1) if seconds else 0.0)
        return None
