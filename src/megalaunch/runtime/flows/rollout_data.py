"""GRPO's dataset inside Megatron's loop: sample i is completion i of the rounds' concatenation, in order
(runtime/flows/rollout_feed.py maps samples to rounds; rounds are consumed as they come, never shuffled:
the generator made them for this point of training). A sample is the chat dataset's (tokens, labels,
loss mask, position ids: runtime/flows/chat_dataset.py, one conversation per sequence) plus, per label
position, the conversation's advantage (`advantages`), its reward (`rewards`, for the metric) and the old
policy's log-probability of the label (`old_logprobs`: the rollouts' own where given, else the policy's at
the round's start as the stage stored them, rollout_old.py; NaN with `old_logprobs: current`: there the old
policy is the current one) and, with kl_coeff > 0, the reference's (`ref_logprobs`, rollout_reference.py).

The data does not come from the run's blend: the recipe keeps `data.mock` (Megatron's builder then asks for
no files) and this class reads RUN/rollouts (`own_data`). A round not brought in yet (a data-loader worker
reading ahead) is waited for on its marker; the step boundary has made sure the iteration's own round is
there (rollout_feed.RolloutFeed.ready), so a wait here only ever concerns samples read ahead."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from megalaunch.runtime.flows.chat_dataset import ChatDocuments, padding_token
from megalaunch.runtime.flows.rollout_feed import POLL_S, FeedConfig, RolloutFeed
from megalaunch.runtime.flows.rollout_format import ADV_SUFFIX, OLD_LOGP_SUFFIX, REWARD_SUFFIX
from megalaunch.runtime.flows.rollout_old import needs_scoring, old_dir, old_stage
from megalaunch.runtime.flows.rollout_reference import reference_complete


class Round:
    """One tokenized round: its documents, side files and (kl_coeff > 0) the reference's scores."""

    def __init__(self, prefix: Path, reference: Path | None = None, old_scores: Path | None = None) -> None:
        self.docs = ChatDocuments(str(prefix))
        self.adv = numpy.fromfile(str(prefix) + ADV_SUFFIX, dtype="<f4")
        self.reward = numpy.fromfile(str(prefix) + REWARD_SUFFIX, dtype="<f4")
        old = Path(str(prefix) + OLD_LOGP_SUFFIX)
        self.old = numpy.memmap(old, dtype="<f4", mode="r") if old.is_file() else None
        self.name = prefix.name
        from megalaunch.runtime.scoring.store import ScoreReader

        self.ref = ScoreReader(reference, prefixes=[str(prefix)]) if reference is not None else None
        self.scored = ScoreReader(old_scores, prefixes=[str(prefix)]) if old_scores is not None else None

    def ref_row(self, doc: int) -> Any:
        return self.ref.get(self.name, doc) if self.ref is not None else None

    def old_row(self, doc: int, n: int) -> numpy.ndarray:
        """Row j < n: log p_old(token j | < j): the rollouts' own where given, else the old policy's as the
        stage scored it at the round's start (rollout_old.py), else NaN (the current policy's)."""
        out = numpy.full(n, numpy.nan, dtype=numpy.float32)
        if self.scored is not None:
            stored = self.scored.get(self.name, doc)
            out[:min(n, len(stored))] = stored[:n]
        if self.old is not None:
            start = int(self.docs.offsets[doc])
            given = numpy.asarray(self.old[start:start + n])
            out = numpy.where(numpy.isnan(given), out, given)
        return out


def _settings(run_dir: Path) -> Any:
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.rank.settings import RuntimeSettings

    return RuntimeSettings.load(RunPaths(run_dir))


def reference_model(run_dir: Path) -> Path | None:
    """The starting model that scores each round for the KL (kl_coeff > 0), from the run's settings."""
    settings = _settings(run_dir)
    kl = float((settings.post_training or {}).get("kl_coeff") or 0.0)
    return Path(settings.from_hf).expanduser() if kl > 0 and settings.from_hf else None


def rounds_feed(run_dir: Path | None = None) -> RolloutFeed:
    """A reading feed (no waiting for files, no tokenizing) over RUN/rollouts."""
    root = run_dir or Path(os.environ.get("MEGALAUNCH_RUN_DIR", "."))
    return RolloutFeed(FeedConfig(source=root, run_dir=root, tokenizer=root, global_batch=1, train_iters=0,
                                  wait_s=0, reference_model=reference_model(root)), is_zero=False)


class RolloutDataset(MegatronDataset):
    """Completions of the rollout rounds, in order (see the module docstring)."""

    own_data = True  # runtime/loop/step.py: built with data.mock, reads RUN/rollouts itself

    def __init__(self, dataset: Any, dataset_path: str | None, indices: numpy.ndarray, num_samples: int | None,
                 index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.num_samples = max(int(num_samples or 0), 1)  # a split not trained on (eval_iters 0) still has one
        self.feed = rounds_feed()
        self.old_stage = old_stage(_settings(self.feed.c.run_dir).post_training)
        self.rounds: dict[int, Round] = {}
        self.pad = padding_token(self._pad_token_id, getattr(config.tokenizer, "vocab_size", None))

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return 1  # the rounds come later; the split's indices are not used

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> Any:
        return None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: Any) -> dict[str, torch.Tensor]:
        if idx is None or self.index_split != Split.train:
            return self.sample(None)
        where = self.feed.locate(int(idx))
        while where is None:  # read ahead of the boundary's check (see the module docstring)
            time.sleep(POLL_S)
            where = self.feed.locate(int(idx))
        k, row = where
        if k not in self.rounds:
            self.rounds[k] = self._round(k + 1)
        return self.sample((self.rounds[k], row))

    def _round(self, k: int) -> Round:
        """Round k (from 1), once its old log-probabilities are stored where the stage computes them (a reader
        ahead of the boundary that scores them waits for them: see the module docstring)."""
        prefix = self.feed.prefix(k)
        old = None
        if self.old_stage and needs_scoring(prefix):
            old = old_dir(self.feed.c.run_dir, prefix.name)
            while not reference_complete(old):
                time.sleep(POLL_S)
        referenced = self.feed.c.reference_model is not None
        return Round(prefix, self.feed._reference_dir(k) if referenced else None, old)

    def sample(self, at: tuple[Round, int] | None) -> dict[str, torch.Tensor]:
        length = self.config.sequence_length + 1
        tokens = numpy.full(length, self.pad, dtype=numpy.int64)
        mask = numpy.zeros(length, dtype=numpy.float32)
        old = numpy.full(length, numpy.nan, dtype=numpy.float32)
        ref = numpy.zeros(length, dtype=numpy.float32)
        adv = reward = 0.0
        if at is not None:
            rnd, doc = at
            ids, bits = rnd.docs.get(doc)
            n = min(len(ids), length)
            tokens[:n], mask[:n] = ids[:n], bits[:n]
            old[:n] = rnd.old_row(doc, n)
            ref_row = rnd.ref_row(doc)
            if ref_row is not None:
                ref[:n] = ref_row[:n]
            adv, reward = float(rnd.adv[doc]), float(rnd.reward[doc])
        return {
            "tokens": torch.from_numpy(tokens[:-1].copy()),
            "labels": torch.from_numpy(tokens[1:].copy()),
            "loss_mask": torch.from_numpy(mask[1:].copy()),
            "position_ids": torch.arange(length - 1, dtype=torch.int64),
            "old_logprobs": torch.from_numpy(old[1:].copy()),  # row t: log p_old(labels[t] | tokens <= t)
            "ref_logprobs": torch.from_numpy(ref[1:].copy()),  # the reference's, likewise (kl_coeff > 0)
            "advantages": torch.full((length - 1,), adv, dtype=torch.float32),
            "rewards": torch.full((length - 1,), reward, dtype=torch.float32),
        }
