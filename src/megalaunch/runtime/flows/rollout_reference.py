"""GRPO's reference for its KL term (post_training.kl_coeff > 0): the starting model's log-probability of every
token of a rollout round, stored beside the round through the score store (runtime/scoring/store.py, kind
"logprobs", one store per round: RUN/scores/reference/<round>/) for the GRPO flow to read.

Rounds arrive while the policy trains, so the reference cannot be scored before training as DPO's is; rank 0
scores each round when it brings it in (runtime/flows/rollout_feed.py), in a process of its own:
`python -m megalaunch.runtime.flows.rollout_reference --prefix RUN/rollouts/round-000003 --model HF_DIR --out
RUN/scores/reference/round-000003 [--max-tokens N]`, with the run's starting model as Hugging Face weights
(`checkpoint.from_hf`, what `submit --from-hf` converted into the run's start; fingerprinted in meta.json).
transformers runs it (float32 on the CPU, bf16 on this rank's GPU); row j of a document is log p(token j |
tokens < j), row 0 and rows past `max_tokens` (what a training sequence holds) zeros. The store is complete
(meta.json) only when every document is scored: a round counts as brought in only then."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE_DIR = "scores/reference"  # RUN/scores/reference/<round>/


def reference_dir(run_dir: Path, stem: str) -> Path:
    return run_dir / REFERENCE_DIR / stem


def reference_complete(directory: Path) -> bool:
    from megalaunch.runtime.scoring.store import read_meta

    meta = read_meta(directory)
    return bool(meta and meta.get("complete"))


def _device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def score_round(prefix: Path, model_dir: Path, out: Path, *, max_tokens: int, batch_tokens: int = 8192) -> float:
    """Score every document of `prefix` with `model_dir` into the store `out`; the tokens per second."""
    import torch
    from transformers import AutoModelForCausalLM

    from megalaunch.runtime.scoring.store import Documents, ScoreWriter, fingerprint, prefix_name

    name, docs = prefix_name(prefix), Documents(prefix)
    writer = ScoreWriter(out, kind="logprobs", prefixes=[str(prefix)],
                         model={"fingerprint": fingerprint(model_dir), "source": str(model_dir)})
    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype).to(device).eval()
    begin, tokens = time.monotonic(), 0
    doc = writer.done(name)
    while doc < len(docs):
        batch = [np.asarray(docs.get(d)[0][:max_tokens], dtype=np.int64)
                 for d in range(doc, min(len(docs), doc + max(1, batch_tokens // max_tokens)))]
        writer.append(name, _logprobs(model, batch, device))
        tokens += sum(len(b) for b in batch)
        doc += len(batch)
    seconds = time.monotonic() - begin
    writer.flush(seconds=seconds, tokens=tokens, complete=True)
    writer.close()
    return tokens / seconds if seconds > 0 else 0.0


def _logprobs(model: Any, batch: list[np.ndarray], device: Any) -> list[np.ndarray]:
    """Row j = log p(token j | < j) of each document (row 0: 0), right-padded into one forward pass."""
    import torch

    width = max(len(b) for b in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, :len(b)], mask[i, :len(b)] = torch.from_numpy(b), 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].to(device)[..., None])[..., 0]
    rows = []
    for i, b in enumerate(batch):
        row = np.zeros(len(b), dtype=np.float32)
        row[1:] = logp[i, :len(b) - 1].cpu().numpy()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalaunch.runtime.flows.rollout_reference",
                                     description="Score a tokenized rollout round with the reference model.")
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--model", required=True, help="the starting model's Hugging Face directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, required=True, help="seq_length + 1: what a sequence holds")
    opts = parser.parse_args(argv)
    rate = score_round(Path(opts.prefix), Path(opts.model), Path(opts.out), max_tokens=opts.max_tokens)
    print(f"reference scored {opts.prefix} into {opts.out} at {rate:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
