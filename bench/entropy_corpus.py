"""A token corpus with a known loss floor, for comparing numerics (bench/fp8.py --stage loss) where no real
data can reach the machine.

Megatron's mock data is a pattern a model memorises (llama3-1b reaches a loss of 0.02 within 200 iterations),
so two precisions cannot be told apart on it. This corpus is drawn from a random sparse bigram model: after each
token, the next is one of `--support` tokens (a random set per token) with Zipf weights (p_i ~ i^-s). Every
document is a fresh draw, so no sequence repeats; the best any model can do is the bigram's conditional
entropy, printed (in nats, the unit of Megatron's loss). A model learns the table over thousands of steps, so the
loss curve falls for long enough to separate two precisions' curves, towards a floor it cannot go below.

    PYTHONPATH=src python bench/entropy_corpus.py --out /tmp/corpus/bigram --tokens 50000000

Writes `<out>.bin/.idx` (Megatron's indexed format, uint16 ids, megalaunch's writer) and `<out>.json` (the
parameters and the entropy)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def zipf(support: int, s: float) -> Any:
    import numpy as np

    w = 1.0 / np.arange(1, support + 1) ** s
    return w / w.sum()


def entropy_nats(p: Any) -> float:
    import numpy as np

    return float(-(p * np.log(p)).sum())


def generate(out: Path, *, vocab: int, support: int, s: float, tokens: int, doc_len: int, seed: int) -> dict[str, Any]:
    import numpy as np

    from megalaunch.data.writer import IndexedWriter

    rng = np.random.default_rng(seed)
    table = np.stack([rng.choice(vocab, size=support, replace=False) for _ in range(vocab)]).astype(np.uint16)
    cdf = np.cumsum(zipf(support, s))
    cdf[-1] = 1.0
    docs = max(1, tokens // doc_len)
    batch = 4096
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(out, dtype="uint16")
    try:
        for start in range(0, docs, batch):
            n = min(batch, docs - start)
            seq = np.empty((n, doc_len), dtype=np.uint16)
            seq[:, 0] = rng.integers(0, vocab, size=n)
            for j in range(1, doc_len):  # every document one step at a time, all documents at once
                pick = np.searchsorted(cdf, rng.random(n))
                seq[:, j] = table[seq[:, j - 1], pick]
            writer.add_array(seq.reshape(-1), [doc_len] * n)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    meta = {"vocab": vocab, "support": support, "zipf_s": s, "documents": docs, "doc_len": doc_len,
            "tokens": docs * doc_len, "seed": seed, "floor_nats": entropy_nats(zipf(support, s)),
            "unigram_nats": math.log(vocab)}
    Path(f"{out}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the dataset prefix (without .bin/.idx)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--support", type=int, default=64, help="next tokens possible after each token")
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of their weights")
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    meta = generate(a.out, vocab=a.vocab, support=a.support, s=a.zipf, tokens=a.tokens, doc_len=a.doc_len, seed=a.seed)
    print(f"{a.out}: {meta['tokens']:,} tokens in {meta['documents']:,} documents; loss floor "
          f"{meta['floor_nats']:.4f} nats (a unigram guess: {meta['unigram_nats']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
