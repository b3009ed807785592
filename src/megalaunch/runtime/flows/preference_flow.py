"""The worked example of a user flow (runtime/flows/flow.py): a preference loss on paired responses.

Data: `megalaunch data sft` on rows `{"prompt": ..., "chosen": ..., "rejected": ...}` writes each pair
as two conversations, chosen then rejected, with the loss mask on each answer. `PairDataset` gives one
pair per sample ([2, seq]: the flow receives [2 x pairs, seq], chosen rows even, rejected rows odd).

Loss (SimPO, Meng et al. 2024: no reference model needed): with r = the mean log-probability of an
answer's tokens, loss = -log sigmoid(beta * (r_chosen - r_rejected) - gamma) per pair, summed over
the micro-batch's pairs (Megatron divides by their count). Metrics: `preference accuracy` (the share
of pairs where r_chosen > r_rejected) and `reward margin` (mean r_chosen - r_rejected).

Use it: `training.flow: megalaunch.runtime.flows.preference_flow:PreferenceFlow` with `data.format: chat`
over pair data; change beta or gamma in a subclass of your own."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megalaunch.runtime.flows.chat_dataset import ChatDataset, ChatDocuments
from megalaunch.runtime.flows.flow import Flow, FlowLoss


class PairDataset(ChatDataset):
    """Preference pairs: documents 2k (chosen) and 2k + 1 (rejected) are pair k."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatDocuments) -> int:
        if len(low_level_dataset) % 2:
            raise ValueError(f"{low_level_dataset.prefix} holds {len(low_level_dataset)} conversations, not pairs; "
                             "fix: write it from rows with 'chosen' and 'rejected' (megalaunch data sft)")
        return len(low_level_dataset) // 2

    def __getitem__(self, idx: Any) -> dict[str, torch.Tensor]:
        if idx is None:
            halves = [self.sample(None), self.sample(None)]
        else:
            pair = int(self.indices[self.order[idx % len(self.order)]])
            halves = [self.sample(2 * pair), self.sample(2 * pair + 1)]
        return {k: torch.stack([h[k] for h in halves]) for k in halves[0]}


class PreferenceFlow(Flow):
    """SimPO: a reference-free preference loss on the mean log-probability of each answer."""

    dataset = PairDataset
    beta = 2.0
    gamma = 0.5

    def loss(self, model: Any, batch: dict[str, Any]) -> FlowLoss:
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        mask = batch["loss_mask"].float()
        mean_logp = -(per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        chosen, rejected = mean_logp[0::2], mean_logp[1::2]
        margin = chosen - rejected
        losses = -F.logsigmoid(self.beta * margin - self.gamma)
        pairs = torch.tensor(float(len(losses)), device=losses.device)
        return FlowLoss(loss=losses.sum(), count=pairs, metrics={
            "preference accuracy": ((margin > 0).float().sum(), pairs),
            "reward margin": (margin.detach().sum(), pairs),
        })
