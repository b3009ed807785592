"""The chat dataset inside Megatron's loop: one conversation per sequence, from the `.bin/.idx` token
datasets and `.mask` loss masks that `megalaunch data sft` writes (tokenization/chat/build.py).

A sample is one conversation: its tokens (truncated to seq_length + 1), padded to seq_length + 1;
inputs are tokens[:-1], labels tokens[1:], and the loss mask is the label's mask byte (1 only where
the label is an assistant's token; 0 on the prompt and on the padding). Position ids start at 0 for
every conversation, so nothing resets mid-sequence and no conversation sees another (why one per
sequence and not packed: docs/finetuning.md). The padding token is the tokenizer's pad token where it has
one that Megatron accepts, else 0 (`padding_token`). The order is a permutation of the split's
conversations per epoch, from the seed: sample i is always the same conversation, so Megatron's
consumed-samples counter resumes the data exactly."""

from __future__ import annotations

from typing import Any

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split

from megalaunch.runtime.flows.chat_format import MASK_SUFFIX


def padding_token(pad: Any, vocab_size: Any = None) -> int:
    """The token id that fills a sequence after its conversation. Any id of the vocabulary would do (padding
    is never a label that counts, loss mask 0, and comes after the conversation under causal attention), so
    the tokenizer's pad where it is one, else 0. What Megatron gives as `pad` depends on the tokenizer: None
    for a Hugging Face tokenizer without a pad token (Llama 3's base models), -1 where the pad token is also
    the end of text (Megatron's "collides" case), an id past the base vocabulary for an added pad token."""
    if isinstance(pad, bool) or not isinstance(pad, (int, numpy.integer)) or pad < 0:
        return 0
    if isinstance(vocab_size, (int, numpy.integer)) and not isinstance(vocab_size, bool) and pad >= vocab_size:
        return 0
    return int(pad)


class ChatDocuments:
    """The low-level dataset: token documents and their loss masks (one byte per token)."""

    def __init__(self, prefix: str, mmap: bool = True) -> None:
        self.prefix = prefix
        self.tokens = IndexedDataset(prefix, multimodal=False, mmap=mmap)
        self.masks = numpy.memmap(prefix + MASK_SUFFIX, dtype=numpy.uint8, mode="r")
        itemsize = self.tokens.index.dtype_size
        self.offsets = self.tokens.index.sequence_pointers // itemsize
        total = int(self.offsets[-1] + self.tokens.index.sequence_lengths[-1]) if len(self.tokens) else 0
        if total != len(self.masks):
            raise ValueError(f"{prefix}{MASK_SUFFIX} holds {len(self.masks)} mask bytes for {total} tokens; "
                             f"fix: write the dataset again with `megalaunch data sft`")

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, doc: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        start, length = int(self.offsets[doc]), int(self.tokens.index.sequence_lengths[doc])
        return self.tokens[doc], self.masks[start:start + length]


class ChatDataset(MegatronDataset):
    """One conversation per sample, the loss on the assistant's tokens (see the module docstring)."""

    def __init__(self, dataset: ChatDocuments, dataset_path: str | None, indices: numpy.ndarray,
                 num_samples: int | None, index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        n = len(indices)
        self.num_samples = num_samples if num_samples is not None else n
        epochs = -(-self.num_samples // max(n, 1))
        seed = config.random_seed + {Split.train: 0, Split.valid: 1, Split.test: 2}[index_split]
        self.order = numpy.concatenate([numpy.random.RandomState(seed + e).permutation(n) for e in range(epochs)]
                                       ) if n else numpy.zeros(0, dtype=numpy.int64)
        self.pad = padding_token(self._pad_token_id, getattr(config.tokenizer, "vocab_size", None))

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatDocuments) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> ChatDocuments:
        return ChatDocuments(dataset_path, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: Any) -> dict[str, torch.Tensor]:
        if idx is None:  # a padding sample (Megatron's samplers may ask for one at the end of the data)
            return self.sample(None)
        return self.sample(int(self.indices[self.order[idx % len(self.order)]]))

    def sample(self, doc: int | None) -> dict[str, torch.Tensor]:
        """Conversation `doc` as one padded sequence (None: all padding, no loss)."""
        length = self.config.sequence_length + 1
        tokens = numpy.full(length, self.pad, dtype=numpy.int64)
        mask = numpy.zeros(length, dtype=numpy.float32)
        if doc is not None:
            ids, bits = self.dataset.get(doc)
            n = min(len(ids), length)
            tokens[:n], mask[:n] = ids[:n], bits[:n]
        return {
            "tokens": torch.from_numpy(tokens[:-1].copy()),
            "labels": torch.from_numpy(tokens[1:].copy()),
            "loss_mask": torch.from_numpy(mask[1:].copy()),
            "position_ids": torch.arange(length - 1, dtype=torch.int64),
        }
