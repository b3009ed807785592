"""Where DPO's reference comes from (post_training.reference; docs/post_training.md, "The reference"), decided
at submit and printed (`submit`, `--dry-run`), and the checks of a post-training run that only a submit makes
(a shipped recipe plans on mock data; it runs on pairs).

- stage: a scoring phase in the run's first segment computes the starting model's log-probabilities of every
  token once and stores them in RUN/scores/reference (runtime/flows/reference.py).
- online: a frozen copy of the starting model in the same job, loaded from the starting checkpoint in every
  segment (runtime/loop/flow_seam.py: frozen_start); needs one (checkpoint.load or --from-hf).
- auto: online where there is a starting checkpoint and the planner's memory model says the policy + a frozen
  bf16 copy of its weights fit the GPU, else stage (a CPU job, or no GPU memory stated: stage)."""

from __future__ import annotations

from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError

GIB = 1024**3


def reference_choice(recipe: Recipe, topo_dp: int = 1, num_microbatches: int = 1,
                     vocab_size: int | None = None) -> tuple[str, str] | None:
    """(stage | online, why) for a run that needs a reference; None for one that does not."""
    pt = recipe.post_training
    if not pt.needs_reference:
        return None
    start = recipe.checkpoint.load or recipe.checkpoint.from_hf
    if pt.reference == "stage":
        return "stage", "post_training.reference stage"
    if pt.reference == "online":
        if not start:
            raise PreflightError("post_training.reference online loads the starting model again in every segment: it "
                                 "needs a starting checkpoint, this run starts from a random initialisation",
                                 field="post_training.reference", valid="stage, or online with checkpoint.load or "
                                 "--from-hf", fix="--set post_training.reference=stage")
        return "online", "post_training.reference online"
    if not start:
        return "stage", "auto: no starting checkpoint to load a frozen copy from"
    fits, note = _fit(recipe, topo_dp, num_microbatches, vocab_size)
    return ("online" if fits else "stage"), "auto: " + note


def _fit(recipe: Recipe, dp: int, num_microbatches: int, vocab_size: int | None) -> tuple[bool, str]:
    """Whether the policy and a frozen bf16 copy of its weights fit one GPU, per the planner's memory model."""
    from megalaunch.config.planner.fit import gpu_memory, model_shape, recipe_layout
    from megalaunch.config.planner.memory import estimate, stage_params

    mem = gpu_memory(recipe)
    if mem is None:
        return False, "no GPU memory stated (a CPU job, or no cluster.gpu / gpu_memory_gb): the stored reference"
    shape = model_shape(recipe, vocab_size)
    layout = recipe_layout(recipe, dp, num_microbatches)
    frozen = 2.0 * stage_params(shape, layout, 0) / GIB
    need = estimate(shape, layout).needed_gib() + frozen
    verdict = "fits" if need <= mem.gib else "does not fit"
    return need <= mem.gib, f"policy + frozen bf16 copy ({frozen:.1f} GiB) ~{need:.0f} GiB of {mem.gib:.0f} GiB: {verdict}"


def check_post_training_submit(recipe: Recipe) -> None:
    """What a submit of a post-training run refuses that a plan does not: DPO / IPO on mock data, an online
    reference without a starting checkpoint."""
    pt = recipe.post_training
    reference_choice(recipe)
    if pt.method in ("dpo", "ipo") and recipe.data.mock:
        raise PreflightError(f"post_training.method {pt.method} trains on preference pairs, not on mock data",
                             field="data", valid="pairs: chat files with prompt/chosen/rejected rows, or "
                             "`megalaunch data sft` output of them",
                             fix=f"submit {recipe.name} --from-hf MODEL_DIR --data PAIRS_DIR")


def job_reference(recipe: Recipe) -> dict[str, str]:
    """The choice as the job reads it (RUN/runtime.json's post_training: `reference_resolved`, `reference_why`)."""
    from megalaunch.config.topology import topology

    topo = topology(recipe)
    choice = reference_choice(recipe, topo.dp, topo.num_microbatches, recipe.data.vocab_size)
    return {"reference_resolved": choice[0], "reference_why": choice[1]} if choice else {}
