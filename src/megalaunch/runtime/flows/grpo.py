"""GRPO's policy update (`post_training.method: grpo`; docs/post_training.md, "GRPO"): the clipped ratio
objective on rollouts from files, with group-normalised advantages.

Per answer token t of a completion with advantage A (computed per group when the round was tokenized:
data/rollouts.py):

    ratio_t = exp(logp_t - old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high) * A) + kl_coeff * k3_t
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (the reference's KL estimator)

averaged over all answer tokens of the step (token-level normalisation, as DAPO and TRL's "dapo" loss
type: every trained token weighs the same, whatever the length of its completion; `calculate_per_token_loss`
makes Megatron divide by the step's token count over micro-batches and data-parallel ranks). `old_t` is the
generator's log-probability where the rollouts gave it (checked against the template's tokens); where they
did not, with `old_logprobs: stage` (the default) the policy's at the round's start, scored at the boundary
before the round's first iteration (runtime/flows/rollout_old.py): the ratio is 1 at that iteration and
moves, clipped, at the round's later ones; with `old_logprobs: current` the old policy is the current one at
each update: old_t = logp_t without its gradient, the ratio is 1 in value and the objective's gradient is
the policy gradient A * grad logp_t. Metrics: `reward` (the mean reward of the step's completions), `advantage` (their mean
advantage), `clip fraction` (tokens whose clipped term is the one taken: ratio below 1 - eps with A < 0, or
above 1 + eps_high with A > 0), `ratio` (mean over tokens), `advantage x logp` (per completion, its
advantage times its mean token log-probability: it rises as good completions become likelier than bad
ones), and `kl` with a reference.

With `kl_coeff > 0`, ref_t is the starting model's log-probability: rank 0 scores each round with it when it
brings the round in (runtime/flows/rollout_reference.py: the run's `checkpoint.from_hf` weights with
transformers, into RUN/scores/reference/<round>/ through the score store); a run without Hugging Face starting
weights is refused at submit (config/preflight.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megalaunch.runtime.flows.flow import Flow, FlowLoss
from megalaunch.runtime.flows.rollout_data import RolloutDataset, reference_model
from megalaunch.runtime.flows.rollout_feed import INTERRUPTED, FeedConfig, RolloutFeed
from megalaunch.runtime.flows.rollout_old import OldScorer, old_stage
from megalaunch.runtime.rank.failures import ConfigFailure

KEYS = ("tokens", "labels", "loss_mask", "position_ids", "old_logprobs", "advantages", "rewards", "ref_logprobs")


def grpo_token_terms(logp: Any, old: Any, adv: Any, *, eps_low: float, eps_high: float,
                     ref: Any = None, kl_coeff: float = 0.0) -> dict[str, Any]:
    """Per-token loss and its parts (tensors of one shape; `old` NaN where the old policy is the current)."""
    old = torch.where(torch.isnan(old), logp.detach(), old)
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    out = {"ratio": ratio.detach(),
           "clipped": ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))}
    if ref is not None and kl_coeff > 0:
        k3 = torch.exp(ref - logp) - (ref - logp) - 1.0
        loss = loss + kl_coeff * k3
        out["kl"] = k3.detach()
    out["loss"] = loss
    return out


class GRPOFlow(Flow):
    """The clipped policy update on rollout rounds (see the module docstring)."""

    dataset = RolloutDataset
    keys = KEYS

    def _eps(self) -> tuple[float, float]:
        low = float(self.config.get("clip_eps", 0.2))
        high = self.config.get("clip_eps_high")
        return low, float(high) if high is not None else low

    def loss(self, model: Any, batch: dict[str, Any]) -> FlowLoss:
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float()
        logp = -per_token
        mask = batch["loss_mask"].float()
        eps_low, eps_high = self._eps()
        kl_coeff = float(self.config.get("kl_coeff", 0.0))
        terms = grpo_token_terms(logp, batch["old_logprobs"].float(), batch["advantages"].float(),
                                 eps_low=eps_low, eps_high=eps_high,
                                 ref=batch["ref_logprobs"].float() if kl_coeff > 0 else None, kl_coeff=kl_coeff)
        tokens = mask.sum()
        answered = (mask.sum(-1) > 0).float()  # rows holding a completion (not padding samples)
        rows = answered.sum()
        adv_row = batch["advantages"][:, 0].float()
        mean_logp = (logp.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        metrics = {
            "reward": ((batch["rewards"][:, 0].float() * answered).sum(), rows),
            "advantage": ((adv_row * answered).sum(), rows),
            "clip fraction": ((terms["clipped"].float() * mask).sum(), tokens),
            "ratio": ((terms["ratio"] * mask).sum(), tokens),
            "advantage x logp": ((adv_row * mean_logp * answered).sum(), rows),
        }
        if "kl" in terms:
            metrics["kl"] = ((terms["kl"] * mask).sum(), tokens)
        return FlowLoss(loss=(terms["loss"] * mask).sum(), count=tokens, metrics=metrics)

    def prepare(self, model: Any, context: Any) -> None:
        """Bring in the round of the segment's first iteration (or stop cleanly), and install the boundary
        gate that brings in each next one (runtime/flows/rollout_feed.py)."""
        from megatron.training import get_args

        from megalaunch.rundir.paths import RunPaths
        from megalaunch.runtime.rank.gates import add_gate, clear_gates

        args = get_args()
        paths = RunPaths(Path(context.run_dir))
        tokenizer = paths.tokenizer if paths.tokenizer.is_dir() else Path(args.tokenizer_model or "")
        if not (tokenizer / "tokenizer_config.json").is_file():
            raise ConfigFailure("grpo renders the rollouts with the model's chat template: the run needs its Hugging "
                                f"Face tokenizer, not {args.tokenizer_type}",
                                fix="submit --from-hf DIR (or --set data.tokenizer_type=HuggingFaceTokenizer "
                                    "--set data.tokenizer_model=DIR)")
        if getattr(args, "dataloader_type", "single") not in (None, "single"):
            raise ConfigFailure(f"grpo reads the rollout rounds in order (sample i of iteration i's round), not with "
                                f"dataloader_type {args.dataloader_type}",
                                fix="drop dataloader_type from megatron_args")
        reference = reference_model(paths.root)
        if float(self.config.get("kl_coeff") or 0.0) > 0 and reference is None:
            raise ConfigFailure("post_training.kl_coeff > 0 needs the starting model as Hugging Face weights to score "
                                "each rollout round with", fix="submit --from-hf DIR, or --set post_training.kl_coeff=0")
        feed = RolloutFeed(FeedConfig(source=Path(self.config["rollouts"]).expanduser(), run_dir=paths.root,
                                      tokenizer=tokenizer, global_batch=int(args.global_batch_size),
                                      train_iters=int(args.train_iters), wait_s=float(self.config["rollout_wait_s"]),
                                      seq_length=int(args.seq_length), job_id=_job_id(), reference_model=reference),
                           is_zero=context.is_zero, log=context.log, ledger=context.ledger, beat=context.beat)
        old = OldScorer(model, feed, micro_batch_size=int(args.micro_batch_size), beat=context.beat) \
            if old_stage(self.config) else None
        clear_gates()
        add_gate(_gate(feed, paths, context.is_zero, old))
        context.act(context.decide())  # the decision runs the gate for the first iteration


def _gate(feed: RolloutFeed, paths: Any, is_zero: bool, old: OldScorer | None) -> Any:
    said: set[str] = set()

    def gate(iteration: int, interrupted: Any) -> bool:
        reason = feed.ready(iteration + 1, interrupted)
        if reason is None and old is not None:  # the round's old log-probabilities, before its first iteration
            reason = old.ensure(iteration + 1, interrupted)
        if reason is None:
            return False
        if reason == INTERRUPTED:  # decide now: the signal's save
            return True
        if is_zero and reason not in said:  # the exit trigger carries the reason into the ledger and status
            import contextlib

            from megalaunch.errors import RunDirError
            from megalaunch.rundir.triggers import TriggerBox

            said.add(reason)
            with contextlib.suppress(RunDirError):  # an exit trigger pending already stops the segment the same
                TriggerBox(paths).write("exit", f"rollouts: {reason}")
        return True

    return gate


def _job_id() -> str:
    from megalaunch.rundir.state import current_job_id

    return current_job_id() or "nojob"
