"""The recipe's `post_training` section: DPO / IPO with a frozen reference, GRPO's policy update from
rollout files, distillation from a teacher (issue 51; docs/post_training.md). Each method is a flow of
megalaunch's own (runtime/flows/), run by Megatron's loop under the chain's guarantees: signal saves,
exact resume, triggers, budgets, status and the report.

The frozen model's numbers (DPO's reference log-probabilities, GRPO's reference for its KL, a teacher's
top-k log-probabilities) are computed by a scoring stage and stored beside the data
(runtime/scoring/), or online in the same job; `reference` picks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megalaunch.config.typed import doc

METHODS = ("none", "dpo", "ipo", "grpo", "distill")

# method -> the built-in flow that runs it (runtime/flows/flow.py's `module:Class`)
BUILTIN_FLOWS = {
    "dpo": "megalaunch.runtime.flows.dpo:DPOFlow",
    "ipo": "megalaunch.runtime.flows.dpo:DPOFlow",
    "grpo": "megalaunch.runtime.flows.grpo:GRPOFlow",
    "distill": "megalaunch.runtime.flows.distill:DistillFlow",
}


@dataclass(frozen=True, kw_only=True)
class PostTrainingConfig:
    """DPO, IPO, GRPO's policy update and distillation (docs/post_training.md)."""

    method: Literal["none", "dpo", "ipo", "grpo", "distill"] = doc(
        "none (pre-training / SFT), dpo (sigmoid loss on preference pairs), ipo (squared loss), grpo (clipped "
        "policy update from rollout files), distill (KL to a teacher's top-k)", "none")
    beta: float = doc("dpo/ipo: strength of the implicit KL to the reference (IPO's tau)", 0.1)
    label_smoothing: float = doc("dpo: the share of pairs assumed mislabelled (conservative DPO), 0 <= x < 0.5", 0.0)
    reference: Literal["auto", "stage", "online"] = doc(
        "where the frozen reference's log-probabilities come from (dpo, ipo; grpo with kl_coeff > 0): stage "
        "(computed once by a scoring stage with the starting model, stored beside the data), online (a frozen "
        "copy in the same job), auto (online when the planner says both models fit, else stage)", "auto")
    rollouts: str | None = doc("grpo: a rollout file, or a directory of round files (round-000001.jsonl, ...) a "
                               "generator writes while the chain trains (docs/post_training.md, hand-off)", None,
                               path="path")
    rollout_wait_s: float = doc("grpo: how long a job waits for the next round's file before it saves and stops", 3600.0)
    clip_eps: float = doc("grpo: the ratio's clip range, 1 - eps .. 1 + eps", 0.2)
    clip_eps_high: float | None = doc("grpo: a different upper clip (DAPO's clip-higher); null: clip_eps", None)
    old_logprobs: Literal["stage", "current"] = doc(
        "grpo, where the rollouts give no old log-probabilities: stage (the policy at each round's start scores "
        "the round before its first iteration, stored in RUN/scores/old: the clipped ratio acts within a round), "
        "current (the old policy is the current one at each update: ratio 1, no scoring)", "stage")
    kl_coeff: float = doc("grpo: weight of the KL to the reference (k3 estimator); 0: no reference needed", 0.0)
    teacher: str | None = doc("distill: the teacher, a Hugging Face model directory or a megatron checkpoint", None,
                              path="path")
    teacher_top_k: int = doc("distill: the teacher's top-k log-probabilities kept per token (the rest of the mass "
                             "in one bucket)", 32)
    kl_direction: Literal["forward", "reverse"] = doc("distill: forward KL(teacher || student) or reverse", "forward")
    hard_label_weight: float = doc("distill: weight of the next-token loss on the data's labels, 0..1 (the KL "
                                   "gets 1 - it)", 0.0)
    temperature: float = doc("distill: softmax temperature of teacher and student", 1.0)
    teacher_mode: Literal["auto", "stage", "online"] = doc(
        "distill: stage (the chain's first stage stores the teacher's top-k beside the data, once), online (the "
        "teacher, a Hugging Face directory, runs frozen in every rank's process and scores each micro-batch: no "
        "store, but the teacher's weights and logits must fit beside the student), auto (online when the planner "
        "says it fits, else stage; config/training/teacher_plan.py)", "stage")

    def __post_init__(self) -> None:
        checks = (
            ("beta", self.beta > 0, "a positive number", "0.1"),
            ("label_smoothing", 0.0 <= self.label_smoothing < 0.5, "0 <= x < 0.5", "0.0"),
            ("rollout_wait_s", self.rollout_wait_s > 0, "> 0 seconds", "3600"),
            ("clip_eps", 0.0 < self.clip_eps < 1.0, "0 < x < 1", "0.2"),
            ("clip_eps_high", self.clip_eps_high is None or self.clip_eps_high > 0, "> 0 or null", "0.28"),
            ("kl_coeff", self.kl_coeff >= 0, ">= 0", "0.0"),
            ("teacher_top_k", 1 <= self.teacher_top_k <= 1024, "1-1024", "32"),
            ("hard_label_weight", 0.0 <= self.hard_label_weight <= 1.0, "0..1", "0.0"),
            ("temperature", self.temperature > 0, "> 0", "1.0"),
        )
        for name, ok, valid, example in checks:
            if not ok:  # NaN fails every comparison: refused too
                raise ValueError(f"post_training.{name} must be {valid}, got {getattr(self, name)!r}; "
                                 f"fix: --set post_training.{name}={example}")
        if self.method == "grpo" and not self.rollouts:
            raise ValueError("post_training.method grpo needs post_training.rollouts (a rollout file or a round "
                             "directory); fix: --set post_training.rollouts=PATH")
        if self.method == "distill" and not self.teacher:
            raise ValueError("post_training.method distill needs post_training.teacher (a Hugging Face model "
                             "directory or a megatron checkpoint); fix: --set post_training.teacher=DIR")

    @property
    def flow(self) -> str | None:
        """The built-in flow for `method` (None: no post-training)."""
        return BUILTIN_FLOWS.get(self.method)

    @property
    def needs_reference(self) -> bool:
        return self.method in ("dpo", "ipo") or (self.method == "grpo" and self.kl_coeff > 0)
