"""DPO and IPO (post_training.method dpo | ipo; docs/post_training.md): preference pairs against a frozen
reference, the starting model, whose log-probabilities a scoring phase stores once (runtime/flows/reference.py).

Data: pairs written by `megalaunch data sft` (chosen rows even, rejected odd: PairDataset). For a pair, with
pi and ref the summed log-probabilities of an answer's tokens under the policy and the reference,
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
- dpo (Rafailov et al. 2023, sigmoid; with label smoothing eps, the conservative DPO of Mitchell 2023):
    loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
- ipo (Azar et al. 2023): loss = (h - 1 / (2 beta))^2, with pi and ref the MEAN log-probability per answer
  token (as TRL's IPO does: the paper's objective is on whole sequences, the mean keeps tau meaningful across
  answer lengths).
Summed over the micro-batch's pairs (Megatron divides by their count). Metrics, per pair, beta times each
answer's log-ratio: `rewards/chosen`, `rewards/rejected`, their difference `rewards/margin` and
`rewards/accuracy` (the share of pairs where the chosen answer's reward is higher).

Checks (a reference that is not the starting model's is refused, ConfigFailure): the stored reference's model
fingerprint and data against this run's at every start; and at the first iteration of a run from iteration 0,
the policy (= the starting model) must reproduce the stored log-probabilities of its first micro-batch."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F

from megalaunch.runtime.flows.flow import Flow, FlowContext, FlowLoss
from megalaunch.runtime.flows.preference_flow import PairDataset
from megalaunch.runtime.flows.reference import (
    reference_for_batch,
    score_reference,
    store_dir,
    stored_mismatch,
    verdict_on_rank_zero,
)
from megalaunch.runtime.rank.failures import ConfigFailure
from megalaunch.runtime.scoring.store import ScoreReader, prefix_name

# the first micro-batch's policy log-probabilities against the stored reference: the largest mean absolute
# difference per answer token still taken as the same model (bf16 GEMMs of other batch shapes differ ~1e-2)
CHECK_TOLERANCE = {True: 0.05, False: 1e-3}  # bf16, fp32


def source_id(prefix: str) -> int:
    """A dataset's number in the batch (`source`): its name's crc32."""
    return zlib.crc32(prefix_name(prefix).encode()) & 0x7FFFFFFF


class DPOPairDataset(PairDataset):
    """Pairs, each row with the document it came from (`document`, -1 for padding) and its dataset (`source`),
    [2, 1] per sample: the flow looks up the stored reference of exactly these tokens."""

    def sample(self, doc: int | None) -> dict[str, torch.Tensor]:
        out = super().sample(doc)
        out["document"] = torch.tensor([-1 if doc is None else int(doc)], dtype=torch.int64)
        out["source"] = torch.tensor([source_id(self.dataset.prefix)], dtype=torch.int64)
        return out


class DPOFlow(Flow):
    """Sigmoid DPO (with label smoothing) and IPO against the stored reference (module docstring)."""

    dataset = DPOPairDataset
    keys = ("tokens", "labels", "loss_mask", "position_ids", "document", "source")

    def __init__(self) -> None:
        self.reader: ScoreReader | None = None
        self.frozen: Any = None  # reference online: the frozen starting model
        self.names: dict[int, str] = {}
        self.check_first = False
        self.tolerance = CHECK_TOLERANCE[True]

    def prepare(self, model: Any, ctx: FlowContext) -> None:
        """Score the reference if this run starts from iteration 0 and it is not complete yet; check it."""
        choice = self.config.get("reference_resolved") or ("online" if self.config.get("reference") == "online"
                                                            else "stage")
        if choice == "online":
            self._prepare_online(ctx)
            return
        names = [prefix_name(p) for p in ctx.prefixes]
        if len(set(names)) != len(names):
            raise ConfigFailure(f"DPO data prefixes must have distinct names (the reference store keys them so): {names}",
                                fix="rename or link the datasets so that no two prefixes share a basename")
        verdict_on_rank_zero(ctx, lambda: stored_mismatch(ctx, need_complete=ctx.iteration > 0))
        if ctx.iteration == 0:
            choice, why = self.config.get("reference_resolved", "stage"), self.config.get("reference_why", "")
            ctx.log(f"reference: {choice} ({why})")
            ctx.ledger("reference", choice=choice, why=why)
            score_reference(model, ctx)
            meta = ScoreReader(store_dir(ctx.run_dir)).meta
            ctx.ledger("reference_scored", seconds=round(meta["seconds"], 3), tokens_per_s=round(meta["tokens_per_s"], 1),
                       documents=meta["documents_done"], source=meta["model"]["source"])
            ctx.log(f"reference: {sum(meta['documents_done'].values())} documents scored in {meta['seconds']:.1f} s "
                    f"({meta['tokens_per_s']:.0f} tokens/s), RUN/scores/reference")
        self.reader = ScoreReader(store_dir(ctx.run_dir), ctx.prefixes)
        self.names = {source_id(p): prefix_name(p) for p in ctx.prefixes}
        self.check_first = ctx.iteration == 0
        self.tolerance = CHECK_TOLERANCE[ctx.bf16]

    def _prepare_online(self, ctx: FlowContext) -> None:
        """The reference in the job: a frozen copy of the starting model, loaded from the starting checkpoint
        in every segment (a copy of the policy would be wrong after a resume)."""
        self.frozen = ctx.frozen_start() if ctx.frozen_start is not None else None
        if self.frozen is None:
            raise ConfigFailure("post_training.reference online needs a starting checkpoint (checkpoint.load or "
                                "--from-hf): a random initialisation cannot be loaded again",
                                fix="--set post_training.reference=stage")
        why = self.config.get("reference_why", "post_training.reference online")
        ctx.log(f"reference: online ({why}): a frozen copy of {ctx.start}")
        if ctx.iteration == 0:
            ctx.ledger("reference", choice="online", why=why)

    def loss(self, model: Any, batch: dict[str, Any]) -> FlowLoss:
        mask = batch["loss_mask"].float()
        if self.frozen is not None:  # online: the frozen starting model's log-probabilities of these labels
            with torch.no_grad():
                ref_tokens = -self.frozen(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        else:
            ref_tokens = self._reference(batch, mask.shape[-1]).to(mask.device)
        if self.check_first:
            self._check(model, batch, mask, ref_tokens)
        logp = -model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        ipo = self.config.get("method") == "ipo"
        pi, ref = (logp * mask).sum(-1), (ref_tokens * mask).sum(-1)
        if ipo:
            length = mask.sum(-1).clamp(min=1.0)
            pi, ref = pi / length, ref / length
        return dpo_objective(pi, ref, mask.sum(-1) > 0, beta=float(self.config.get("beta", 0.1)),
                             label_smoothing=float(self.config.get("label_smoothing", 0.0)), ipo=ipo)

    def _reference(self, batch: dict[str, Any], seq: int) -> torch.Tensor:
        if self.reader is None:
            raise ConfigFailure("the DPO flow ran without its reference (prepare was not called)",
                                fix="run it as post_training.method dpo, not as training.flow")
        rows = reference_for_batch(self.reader, self.names, batch["document"].reshape(-1).cpu(),
                                   batch["source"].reshape(-1).cpu(), seq)
        return torch.from_numpy(rows)

    def _check(self, model: Any, batch: dict[str, Any], mask: torch.Tensor, ref_tokens: torch.Tensor) -> None:
        """The policy is still the starting model: its log-probabilities of this micro-batch (eval mode, no
        graph) must be the stored reference's. Every rank learns whether any rank found them different."""
        from megalaunch.runtime.rank.collectives import any_rank

        self.check_first = False
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logp = -model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        finally:
            model.train(was_training)
        diff = ((logp - ref_tokens).abs() * mask).sum() / mask.sum().clamp(min=1.0)
        bad = bool(diff > self.tolerance)
        if any_rank(bad):
            raise ConfigFailure(f"the DPO reference in RUN/scores/reference does not match the starting model: its "
                                f"log-probabilities of the first micro-batch differ by {float(diff):.4g} per answer "
                                f"token on average (tolerance {self.tolerance})",
                                fix="delete RUN/scores/reference to score again with the starting model")


def dpo_objective(pi: torch.Tensor, ref: torch.Tensor, real: torch.Tensor, *, beta: float,
                  label_smoothing: float = 0.0, ipo: bool = False) -> FlowLoss:
    """The loss and metrics of pairs from per-row answer log-probabilities (rows: chosen even, rejected odd);
    `real`: rows that hold an answer (padding pairs count for nothing)."""
    ratio_c, ratio_r = pi[0::2] - ref[0::2], pi[1::2] - ref[1::2]
    h = ratio_c - ratio_r
    keep = (real[0::2] & real[1::2]).float()
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    pairs = keep.sum()
    chosen, rejected = (beta * ratio_c).detach(), (beta * ratio_r).detach()
    return FlowLoss(loss=(losses * keep).sum(), count=pairs, metrics={
        "rewards/chosen": ((chosen * keep).sum(), pairs),
        "rewards/rejected": ((rejected * keep).sum(), pairs),
        "rewards/margin": (((chosen - rejected) * keep).sum(), pairs),
        "rewards/accuracy": (((chosen > rejected).float() * keep).sum(), pairs),
    })
