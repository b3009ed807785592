"""Documents -> token ids: tokenizers' fast batch encoding with an explicit BOS/EOS policy, one
flat numpy array per batch. No datatrove here: the login node uses it to check a recipe."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from megalaunch.errors import PreflightError


class Encoder:
    """tokenizers' fast batch encoding + explicit BOS/EOS, returning one flat numpy array per batch."""

    def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_id: int | None,
                 add_special_tokens: bool, dtype: str) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_special_tokens = add_special_tokens
        self.dtype = dtype

    def encode(self, texts: list[str]) -> tuple[Any, list[int]]:
        import numpy as np

        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=self.add_special_tokens)
        ids = [e.ids for e in encodings]
        lengths = [len(x) for x in ids]
        flat = np.fromiter(_chain(ids), dtype=self.dtype, count=sum(lengths))
        if self.bos_id is None and self.eos_id is None:
            return flat, lengths
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        ends = starts + np.asarray(lengths, dtype=np.int64)
        positions: Any
        values: Any
        if self.bos_id is not None and self.eos_id is not None:
            positions = np.empty(2 * len(lengths), dtype=np.int64)
            positions[0::2], positions[1::2] = starts, ends
            values = np.empty(2 * len(lengths), dtype=self.dtype)
            values[0::2], values[1::2] = self.bos_id, self.eos_id
            extra = 2
        elif self.bos_id is not None:
            positions, values, extra = starts, self.bos_id, 1
        else:
            positions, values, extra = ends, self.eos_id, 1
        return np.insert(flat, positions, values), [n + extra for n in lengths]

    def encode_one(self, text: str) -> list[int]:
        """Reference path, document by document (tests compare the pipeline against it)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids)
        return ([self.bos_id] if self.bos_id is not None else []) + ids + \
            ([self.eos_id] if self.eos_id is not None else [])


def _chain(lists: list[list[int]]) -> Iterator[int]:
    for x in lists:
        yield from x


def load_encoder(path: str, *, bos: str | None, eos: str | None, add_special_tokens: bool = False) -> Encoder:
    from tokenizers import Tokenizer

    from megalaunch.data.writer import token_dtype_for_vocab

    tokenizer = Tokenizer.from_file(check_tokenizer_file(path))
    ids: dict[str, int | None] = {}
    for role, token in (("bos", bos), ("eos", eos)):
        if token is None:
            ids[role] = None
            continue
        ids[role] = tokenizer.token_to_id(token)
        if ids[role] is None:
            raise PreflightError(f"token {token!r} is not in the vocabulary of {path}",
                                 field=f"tokenizer.{role}",
                                 fix=f"name a special token of this tokenizer, or set tokenizer.{role}: null")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return Encoder(tokenizer, bos_id=ids["bos"], eos_id=ids["eos"], add_special_tokens=add_special_tokens,
                   dtype=token_dtype_for_vocab(vocab))


def check_tokenizer_file(path: str) -> str:
    """The local tokenizer.json that `path` names (a file, or a directory holding one); compute nodes
    cannot reach a hub, so anything else is an error."""
    if not path:
        raise PreflightError("no tokenizer given", field="tokenizer.path",
                             fix="--set tokenizer.path=/path/to/tokenizer.json")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        hint = " (a hub name? hubs are unreachable from compute nodes: download it first)" \
            if "/" in path and not path.startswith(("/", ".", "~")) else ""
        raise PreflightError(f"tokenizer {path} is not a local file{hint}", field="tokenizer.path",
                             valid="a path to a tokenizer.json",
                             fix="save the tokenizer with tokenizer.save('tokenizer.json') and point at it")
    if not os.access(path, os.R_OK):
        raise PreflightError(f"tokenizer {path} is not readable", field="tokenizer.path")
    return path
