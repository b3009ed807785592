"""Generated corpora and locally trained tokenizers for tests and the benchmark (no downloads).

Text is word salad with a Zipf-like vocabulary, punctuation and numbers: close enough to prose that
a BPE tokenizer trained on it compresses like on real text (~4 bytes per token)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

_SYLLABLES = ["ka", "ro", "mi", "te", "la", "sun", "dor", "vi", "ne", "tha", "qua", "pre", "ion", "ment", "ing", "er", "al", "os", "ur", "im", "sta", "ble", "con", "tri", "de", "ex", "ph", "lo", "ra", "gu", "be", "fi", "no", "wa", "ze", "ck", "sh", "ou", "ei", "ab", "el"]
_PUNCT = (",", ",", ".", ".", ".", ";", ":", "!", "?")


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))))
    return sorted(words)


def documents(n_docs: int, *, seed: int = 0, mean_words: int = 300) -> Iterator[str]:
    """`n_docs` documents of ~`mean_words` words each (deterministic for a seed)."""
    rng = random.Random(seed)
    vocab = _vocabulary(rng, 20000)
    weights = [1.0 / (rank + 10) for rank in range(len(vocab))]
    for _ in range(n_docs):
        n_words = max(3, int(rng.expovariate(1.0 / mean_words)))
        words = rng.choices(vocab, weights=weights, k=n_words)
        parts: list[str] = []
        for i, word in enumerate(words):
            if i == 0 or parts[-1][-1] in ".!?":
                word = word.capitalize()
            if rng.random() < 0.02:
                word = str(rng.randint(0, 10000))
            if rng.random() < 0.08:
                word += rng.choice(_PUNCT)
            parts.append(word)
        text = " ".join(parts)
        if rng.random() < 0.3:
            text = text.replace(". ", ".\n\n", 2)
        yield text


def write_jsonl_corpus(folder: str | os.PathLike[str], *, n_files: int, docs_per_file: int, seed: int = 0,
                       mean_words: int = 300, compress: bool = False) -> list[Path]:
    """Write `n_files` jsonl(.gz) files of `{"id", "text"}` records; returns their paths."""
    import gzip

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(n_files * docs_per_file, seed=seed, mean_words=mean_words)
    paths = []
    for f in range(n_files):
        path = folder / f"part_{f:04d}.jsonl{'.gz' if compress else ''}"
        opener = gzip.open if compress else open
        with opener(path, "wt", encoding="utf-8") as out:
            for d in range(docs_per_file):
                out.write(json.dumps({"id": f"{f}-{d}", "text": next(docs)}) + "\n")
        paths.append(path)
    return paths


def train_bpe_tokenizer(path: str | os.PathLike[str], texts: Iterator[str] | list[str], *, vocab_size: int,
                        eos: str = "<|endoftext|>", bos: str = "<|begin_of_text|>") -> Path:
    """Train a byte-level BPE tokenizer with `tokenizers` and save it as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, bos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path
