"""Distillation's per-token loss against a teacher's stored top-k (runtime/flows/distill.py; docs/post_training.md).

Buckets: the teacher's k ids and one 'rest' bucket. The teacher's stored log-probabilities lt (temperature 1)
give the rest mass 1 - sum(exp(lt)); the student's full-vocabulary log-softmax at temperature T gives its
log-probabilities ls on the k ids and its rest 1 - sum(exp(ls)) (exact: the student's whole distribution is
there). At temperature T the teacher is re-normalised over what is stored: its k + 1 buckets' log-masses
[lt, log rest] divided by T and log-softmaxed. This is exact at T = 1; at T != 1 it treats the rest as one
token (the true tempered rest spreads over many ids and would be larger for T > 1): an approximation that
only moves the rest bucket, which holds little mass for a useful k.

    forward KL = sum_b p_t,b (log p_t,b - log p_s,b)      reverse KL = sum_b p_s,b (log p_s,b - log p_t,b)
    loss per answer token = (1 - w) * T^2 * KL + w * CE(label)     (T^2 as Hinton et al. 2015)

CE is the ordinary next-token loss at temperature 1. Under tensor parallelism the logits are vocab-parallel
([.., V / tp] per rank): the softmax's max and sum and the gathers of the k ids and the label are reduced
across the tensor-parallel group (`Reductions`), so every rank computes the same loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TINY = 1e-30  # the least mass a bucket is given (a rest that rounds to <= 0); log(TINY) = -69


@dataclass(frozen=True)
class Reductions:
    """How per-rank partial results become the whole vocabulary's: identity without tensor parallelism."""

    vocab_start: int = 0  # the first vocabulary id of this rank's logits
    sum: Callable[[Any], Any] = lambda x: x  # all-reduce SUM whose backward is the identity
    max: Callable[[Any], Any] = lambda x: x  # all-reduce MAX, no gradient


def tensor_parallel_reductions(local_vocab: int) -> Reductions:
    """Megatron's tensor-parallel group: this rank's slice of the vocabulary and its reductions."""
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if mpu.get_tensor_model_parallel_world_size() == 1:
        return Reductions()
    group = mpu.get_tensor_model_parallel_group()

    def all_max(x: Any) -> Any:
        x = x.detach().clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x

    start = mpu.get_tensor_model_parallel_rank() * local_vocab
    return Reductions(vocab_start=start, sum=reduce_from_tensor_model_parallel_region, max=all_max)


def _log_softmax_stats(z: Any, red: Reductions) -> tuple[Any, Any]:
    """(max, log-sum-exp) of each row of the vocabulary-parallel logits z [N, V / tp]."""
    m = red.max(z.detach().max(dim=-1).values)
    lse = m + torch.log(red.sum(torch.exp(z - m.unsqueeze(-1)).sum(dim=-1)))
    return m, lse


def _gather(z: Any, ids: Any, red: Reductions) -> Any:
    """z at the (global) vocabulary ids [N, j]: each rank contributes the ids of its slice."""
    local = ids - red.vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1))
    return red.sum(torch.where(mine, picked, torch.zeros_like(picked)))


def _rest(logp_k: Any) -> Any:
    """log(1 - sum(exp(logp_k))) per row, the rest's mass floored at TINY."""
    return torch.log((1.0 - torch.exp(logp_k).sum(dim=-1)).clamp(min=TINY))


@dataclass
class DistillTerms:
    """Per-token terms [N]: the KL at temperature T (without T^2), the hard-label CE, top-1 agreement."""

    kl: Any
    ce: Any
    agree: Any


def distill_terms(logits: Any, teacher_ids: Any, teacher_logp: Any, labels: Any, *, temperature: float = 1.0,
                  direction: str = "forward", red: Reductions | None = None) -> DistillTerms:
    """logits [N, V / tp] (this rank's vocabulary slice), teacher_ids / teacher_logp [N, k], labels [N]."""
    red = red or Reductions()
    t = float(temperature)
    z1 = logits.float()
    z = z1 / t if t != 1.0 else z1
    m, lse = _log_softmax_stats(z, red)
    ids = teacher_ids.long()
    student_k = _gather(z, ids, red) - lse.unsqueeze(-1)
    student = torch.cat([student_k, _rest(student_k).unsqueeze(-1)], dim=-1)
    stored = teacher_logp.float()
    teacher = torch.log_softmax(torch.cat([stored, _rest(stored).unsqueeze(-1)], dim=-1) / t, dim=-1)
    if direction == "forward":
        kl = (torch.exp(teacher) * (teacher - student)).sum(dim=-1)
    elif direction == "reverse":
        kl = (torch.exp(student) * (student - teacher)).sum(dim=-1)
    else:
        raise ValueError(f"post_training.kl_direction must be forward or reverse, got {direction!r}")
    lse1 = lse if t == 1.0 else _log_softmax_stats(z1, red)[1]
    ce = lse1 - _gather(z1, labels.long().unsqueeze(-1), red).squeeze(-1)
    top1 = ids.gather(-1, stored.argmax(dim=-1, keepdim=True))
    agree = (_gather(z.detach(), top1, red).squeeze(-1) >= m).float()
    return DistillTerms(kl=kl, ce=ce, agree=agree)


def distill_loss(terms: DistillTerms, mask: Any, *, temperature: float = 1.0, hard_label_weight: float = 0.0
                 ) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
    """(loss summed over the answer tokens, their count, metrics as (sum, count)) from per-token terms."""
    on = mask.reshape(-1) > 0
    w, t = float(hard_label_weight), float(temperature)
    per_token = (1.0 - w) * t * t * terms.kl + w * terms.ce
    zero = torch.zeros_like(per_token)
    count = on.float().sum()
    metrics = {
        "distill kl": (torch.where(on, terms.kl, zero).detach().sum(), count),
        "hard-label ce": (torch.where(on, terms.ce, zero).detach().sum(), count),
        "top-1 agreement": (torch.where(on, terms.agree, zero).detach().sum(), count),
    }
    return torch.where(on, per_token, zero).sum(), count, metrics
