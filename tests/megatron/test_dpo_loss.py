"""The DPO flow's loss and metrics (runtime/flows/dpo.py) equal the objectives written out here with plain
torch, on a fixed batch of pairs: per-token log-probabilities computed by the test from a policy and a
reference model of its own, the reference's stored through the score store (so the store's row alignment
with the batch's labels is checked too). Sigmoid DPO with and without label smoothing, and IPO (mean
log-probability per answer token)."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
from megalaunch.runtime.flows.dpo import DPOFlow, source_id
from megalaunch.runtime.scoring.store import ScoreReader, ScoreWriter

pytestmark = [pytest.mark.megatron]

VOCAB, SEQ = 32, 12


class TinyLM(torch.nn.Module):
    """A causal LM with Megatron's GPT signature: model(tokens, position_ids, mask, labels=) -> per-token loss."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 16, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(SEQ, 16, generator=g) * 0.1)
        self.out = torch.nn.Parameter(torch.randn(16, VOCAB, generator=g))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb[tokens] + self.pos[: tokens.shape[-1]]
        h = torch.cumsum(h, dim=1) / torch.arange(1, tokens.shape[-1] + 1).view(1, -1, 1)
        return h @ self.out

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: object, *, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def _dataset(prefix: Path, docs: list[list[int]], masks: list[list[int]]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    np.array([t for d in docs for t in d], dtype=np.int32).tofile(str(prefix) + ".bin")
    np.array([m for d in masks for m in d], dtype=np.uint8).tofile(str(prefix) + ".mask")
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64) * 4
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(docs), len(docs) + 1))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def _token_logp(model: TinyLM, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[j + 1] | tokens[<= j]) for every j, written independently of the flow."""
    logp = torch.log_softmax(model.logits(tokens[:, :-1]).double(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def batch_and_models(tmp_path: Path) -> tuple[dict, TinyLM, DPOFlow, torch.Tensor]:
    rng = np.random.default_rng(0)
    docs, masks = [], []
    for _ in range(3):  # 3 pairs: a shared prompt, two different answers (the last pair's answers are truncated)
        prompt = rng.integers(1, VOCAB, size=4).tolist()
        for _ in range(2):
            n = int(rng.integers(3, 12))
            docs.append(prompt + rng.integers(1, VOCAB, size=n).tolist())
            masks.append([0] * 4 + [1] * n)
    prefix = tmp_path / "data" / "pairs"
    _dataset(prefix, docs, masks)
    policy, reference = TinyLM(1), TinyLM(2)
    writer = ScoreWriter(tmp_path / "ref", kind="logprobs", prefixes=[str(prefix)],
                         model={"fingerprint": "x", "source": "test"})
    with torch.no_grad():
        for d in docs:
            row = _token_logp(reference, torch.tensor([d])).float()[0].numpy()
            writer.append("pairs", [np.concatenate([[0.0], row[:SEQ]])])
    writer.flush(complete=True)
    tokens = np.zeros((len(docs), SEQ + 1), dtype=np.int64)
    mask = np.zeros((len(docs), SEQ + 1), dtype=np.float32)
    for i, (d, m) in enumerate(zip(docs, masks, strict=True)):
        n = min(len(d), SEQ + 1)
        tokens[i, :n], mask[i, :n] = d[:n], m[:n]
    t = torch.from_numpy(tokens)
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.from_numpy(mask[:, 1:]),
             "position_ids": torch.arange(SEQ).expand(len(docs), SEQ),
             "document": torch.arange(len(docs)).view(-1, 1), "source": torch.full((len(docs), 1), source_id(str(prefix)))}
    flow = DPOFlow()
    flow.reader = ScoreReader(tmp_path / "ref", [str(prefix)])
    flow.names = {source_id(str(prefix)): "pairs"}
    with torch.no_grad():
        ref_tok = _token_logp(reference, t)
    return batch, policy, flow, ref_tok


@pytest.mark.parametrize(("method", "beta", "smoothing"), [("dpo", 0.1, 0.0), ("dpo", 0.5, 0.2), ("ipo", 0.3, 0.0)])
def test_loss_and_metrics_equal_the_objective_written_out(batch_and_models, method: str, beta: float,
                                                          smoothing: float) -> None:
    batch, policy, flow, ref_tok = batch_and_models
    flow.config = {"method": method, "beta": beta, "label_smoothing": smoothing}
    out = flow.loss(policy, batch)

    mask = batch["loss_mask"].double()
    pol_tok = _token_logp(policy, torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1))
    pi, ref = (pol_tok * mask).sum(1), (ref_tok * mask).sum(1)
    if method == "ipo":
        pi, ref = pi / mask.sum(1), ref / mask.sum(1)
    want_loss, chosen_r, rejected_r = 0.0, [], []
    for k in range(3):
        c, r = 2 * k, 2 * k + 1
        h = float((pi[c] - ref[c]) - (pi[r] - ref[r]))
        if method == "ipo":
            want_loss += (h - 1 / (2 * beta)) ** 2
        else:
            sig = 1 / (1 + math.exp(-beta * h))
            want_loss += -(1 - smoothing) * math.log(sig) - smoothing * math.log(1 - sig)
        chosen_r.append(beta * float(pi[c] - ref[c]))
        rejected_r.append(beta * float(pi[r] - ref[r]))

    assert float(out.count) == 3
    assert float(out.loss) == pytest.approx(want_loss, rel=1e-5)
    got = {k: float(s) / float(n) for k, (s, n) in out.metrics.items()}
    assert got["rewards/chosen"] == pytest.approx(sum(chosen_r) / 3, rel=1e-5, abs=1e-6)
    assert got["rewards/rejected"] == pytest.approx(sum(rejected_r) / 3, rel=1e-5, abs=1e-6)
    assert got["rewards/margin"] == pytest.approx((sum(chosen_r) - sum(rejected_r)) / 3, rel=1e-5, abs=1e-6)
    assert got["rewards/accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen_r, rejected_r, strict=True)) / 3)
    out.loss.backward()  # the loss carries the policy's graph
    assert policy.out.grad is not None and float(policy.out.grad.abs().sum()) > 0
