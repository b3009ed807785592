"""`parallel: auto`: the layout a job runs with, chosen by the planner (config/planner/plan.py) for the nodes,
GPUs per node and GPU type the recipe asks for, when the recipe is loaded (config/loader.py), so that every
command sees the layout that will run and run.yaml records it (each field's origin: `parallel: auto (...)`).

The layout is the fields of `LAYOUT_FIELDS`: TP, PP, VPP, CP, sequence parallelism, micro-batch,
recompute, data sharding and, for a mixture-of-experts model, EP and expert TP (the planner's: expert TP 1, EP a
divisor of the experts and of TP x CP x DP, SP on with TP > 1; a dense model's stay as written). A field the recipe file, an include or `--set` gives is *pinned*: its value wins and the planner
chooses the rest around it (the fastest layout with those values). `parallel: auto` written as a value (or
`--set parallel=auto`) unpins what came before it: every layout field is the planner's unless given later.
`parallel.layout: pinned` (the schema's default, for recipes that do not say auto) keeps every field as
written. Either way, a layout the planner predicts `SLOWER` or more slower than its first is named
(`LayoutChoice.slower`), with the switch.

Where the planner cannot rank (a CPU job, no or an unknown `cluster.gpu`, a `workload` run, pinned values outside the layouts it enumerates), the layout is the recipe's as written
(schema defaults for the rest: TP 1, PP 1, micro-batch 1), with the reason in `LayoutChoice.reason`.
Resume never plans: run.yaml
holds the resolved fields (launcher/prepare/resume_check.py re-plans only for `resume --set parallel=auto`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError, PreflightError

LAYOUT_FIELDS = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                 "parallel.virtual_pipeline_model_parallel_size", "parallel.context_parallel_size",
                 "parallel.sequence_parallel", "training.micro_batch_size", "training.recompute",
                 "parallel.data_sharding", "parallel.expert_model_parallel_size",
                 "parallel.expert_tensor_parallel_size")
SLOWER = 0.10  # a layout predicted this much slower than the planner's first is named at submit
SWITCH = "--set parallel=auto"


@dataclass(frozen=True)
class LayoutChoice:
    """What runs, why, and what the planner predicted for it; recorded in RUN/plan.json."""

    mode: str  # parallel.layout: auto | pinned
    layout: str  # Layout.describe() of what runs
    reason: str  # why this layout, one clause
    planned: bool = False  # the planner chose the unpinned fields
    pinned: dict[str, Any] = field(default_factory=dict)  # dotted field -> [value, origin]
    inputs: dict[str, Any] = field(default_factory=dict)  # what the planner was given
    predicted: dict[str, float] | None = None  # of what runs: step_s, memory_gib, tokens_per_s, tflops, mfu
    first: dict[str, Any] | None = None  # the planner's first: layout, step_s, memory_gib, set
    runner_up: dict[str, Any] | None = None  # the next layout (auto), for the dry run's why
    considered: int = 0
    fitting: int = 0
    refusal: dict[str, str] | None = None  # nothing fits: the PreflightError submit raises (`check_fits`)

    @property
    def slower(self) -> float | None:
        """How much slower than the planner's first what runs is predicted (0.12: 12 %), None: unknown."""
        if not self.predicted or not self.first or not self.first.get("step_s"):
            return None
        return self.predicted["step_s"] / self.first["step_s"] - 1.0

    @property
    def warn(self) -> bool:
        return self.slower is not None and self.slower >= SLOWER

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "slower": self.slower}


def layout_values(recipe: Recipe) -> dict[str, Any]:
    """The recipe's layout fields; an MoE model's expert TP as Megatron resolves it (null: TP)."""
    from megalaunch.config.model.moe import expert_tensor_parallel_size, is_moe

    p, t = recipe.parallel, recipe.training
    etp = expert_tensor_parallel_size(recipe) if is_moe(recipe.model) else p.expert_tensor_parallel_size
    return dict(zip(LAYOUT_FIELDS, (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                    p.virtual_pipeline_model_parallel_size, p.context_parallel_size,
                                    p.sequence_parallel, t.micro_batch_size, t.recompute, p.data_sharding,
                                    p.expert_model_parallel_size, etp), strict=True))


def _candidate_values(layout: Any) -> dict[str, Any]:
    return dict(zip(LAYOUT_FIELDS, (layout.tp, layout.pp, layout.vpp, layout.cp, layout.sequence_parallel,
                                    layout.micro_batch, layout.recompute, layout.sharding, layout.ep, layout.etp),
                    strict=True))


def unpin(tree: dict[str, Any], prov: dict[str, str]) -> None:
    """`parallel: auto` as a value: every layout field given so far is the planner's again."""
    for dotted in LAYOUT_FIELDS:
        section, name = dotted.split(".")
        node = tree.get(section)
        if isinstance(node, dict):
            node.pop(name, None)
        prov.pop(dotted, None)


def _apply(recipe: Recipe, values: dict[str, Any]) -> Recipe:
    v = {k.split(".")[1]: x for k, x in values.items()}
    parallel = dataclasses.replace(recipe.parallel, **{k: x for k, x in v.items()
                                                        if k in recipe.parallel.__dataclass_fields__})
    training = dataclasses.replace(recipe.training, **{k: x for k, x in v.items()
                                                        if k in recipe.training.__dataclass_fields__})
    return dataclasses.replace(recipe, parallel=parallel, training=training)


def _unplannable(recipe: Recipe) -> str | None:
    """Why the planner cannot rank this recipe's layouts, or None."""
    from megalaunch.config.planner.gpus import gpu_spec, known_gpus

    cl = recipe.cluster
    if recipe.workload:
        return "a workload runs instead of Megatron"
    if cl.gpus_per_node == 0:
        return "a CPU job (cluster.gpus_per_node 0): the planner ranks GPU layouts"
    if not cl.gpu:
        return "no cluster.gpu to plan for: set it (e.g. --set cluster.gpu=H100)"
    if gpu_spec(cl.gpu) is None:
        return f"cluster.gpu {cl.gpu!r} is not one the planner knows ({known_gpus()})"
    return None


def _vocab(recipe: Recipe) -> int | None:
    from megalaunch.config.preflight import tokenizer_vocab_size

    try:
        return tokenizer_vocab_size(recipe)
    except (MegalaunchError, OSError, ValueError):  # preflight says what is wrong with the tokenizer
        return None


def _summary(c: Any, peak_tflops: float) -> dict[str, float]:
    return {"step_s": c.step_s, "memory_gib": c.memory.needed_gib(), "tokens_per_s": c.tokens_per_s,
            "tflops": c.tflops, "mfu": c.tflops / peak_tflops if peak_tflops else 0.0}


def _brief(c: Any) -> dict[str, Any]:
    from megalaunch.config.planner.plan import set_lines

    return {"layout": c.layout.describe(), "step_s": c.step_s, "memory_gib": c.memory.needed_gib(),
            "set": set_lines(c.layout)}


def resolve_layout(recipe: Recipe, prov: dict[str, str]) -> tuple[Recipe, dict[str, str], LayoutChoice]:
    """The recipe with its layout resolved, the provenance of the chosen fields, and the choice (with the refusal
    `check_fits` raises when `parallel: auto` finds no layout that fits the GPUs' memory)."""
    from megalaunch.config.planner.plan import plan_recipe

    mode = recipe.parallel.layout
    current = layout_values(recipe)
    pinned = {k: [current[k], prov[k]] for k in LAYOUT_FIELDS if prov.get(k, "default") != "default"}
    if recipe.post_training.method != "none" or recipe.training.flow:  # flows: PP 1 and CP 1 (config/schema.py)
        for k in ("parallel.pipeline_model_parallel_size", "parallel.context_parallel_size"):
            pinned.setdefault(k, [1, "a flow (post_training, training.flow) runs with 1"])
    described = describe_layout(recipe)
    why_not = _unplannable(recipe)
    if why_not is not None:
        return recipe, {}, LayoutChoice(mode, described, f"as written: {why_not}", pinned=pinned)
    try:
        plan = plan_recipe(recipe, _vocab(recipe))
    except PreflightError as e:  # no layout divides the world and batch: preflight says so for this one
        return recipe, {}, LayoutChoice(mode, described, f"as written: the planner has no layout ({e.message})",
                                        pinned=pinned)
    cands = plan.candidates
    inputs = {"nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node, "gpu": plan.gpu.name,
              "memory_gib": plan.memory_gib, "world": plan.nodes * plan.gpus_per_node,
              "global_batch_size": recipe.training.global_batch_size, "seq_length": recipe.model.seq_length,
              "model": f"{recipe.model.num_layers} layers x {recipe.model.hidden_size} hidden"}
    common: dict[str, Any] = {"pinned": pinned, "inputs": inputs, "first": _brief(plan.best) if plan.best else None,
                              "considered": len(cands), "fitting": sum(c.fits for c in cands)}
    if mode == "pinned":
        own = next((c for c in cands if _candidate_values(c.layout) == current), None)
        return recipe, {}, LayoutChoice(
            mode, described, "as written (parallel.layout: pinned)",
            predicted=_summary(own, plan.gpu.peak_tflops) if own else None, **common)
    want = {k: v for k, (v, _) in pinned.items()}
    matching = [c for c in cands if all(_candidate_values(c.layout)[k] == v for k, v in want.items())]
    if not matching:
        return recipe, {}, LayoutChoice(mode, described, "as written: no layout the planner enumerates has the "
                                        "pinned values", **common)
    chosen = next((c for c in matching if c.fits), None)
    if chosen is None:  # refused at submit, not here: a recipe is also loaded to convert, show or size it
        refusal = _nothing_fits(recipe, plan, want)
        return recipe, {}, LayoutChoice(mode, described, "as written: no layout fits", **common,
                                        refusal={"message": refusal.message, "field": refusal.field or "parallel",
                                                 "valid": refusal.valid or "", "fix": refusal.fix or ""})
    values = _candidate_values(chosen.layout)
    recipe = _apply(recipe, values)
    origin = f"parallel: auto ({plan.nodes} x {plan.gpus_per_node} {plan.gpu.name})"
    chosen_prov = {k: origin for k in LAYOUT_FIELDS if k not in pinned}
    runner = next((c for c in matching if c.fits and c is not chosen), None)
    reason = (f"the planner's first of {common['fitting']:,} layouts that fit" if not pinned
              else f"the planner's first with the pinned {', '.join(want)}")
    return recipe, chosen_prov, LayoutChoice(
        mode, chosen.layout.describe(), reason, planned=True, predicted=_summary(chosen, plan.gpu.peak_tflops),
        runner_up=_brief(runner) if runner else None, **common)


def check_fits(choice: LayoutChoice | None) -> None:
    """Submit's refusal when `parallel: auto` found no layout that fits the GPUs' memory: one line."""
    if choice is not None and choice.refusal is not None:
        raise PreflightError(**choice.refusal)


def describe_layout(recipe: Recipe) -> str:
    """The recipe's layout in the planner's words (Layout.describe)."""
    from megalaunch.config.planner.fit import expert_layout
    from megalaunch.config.planner.memory import Layout

    p, t = recipe.parallel, recipe.training
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
                  dp=max(1, recipe.cluster.world_size // max(mp, 1)), vpp=p.virtual_pipeline_model_parallel_size,
                  micro_batch=t.micro_batch_size, recompute=t.recompute,
                  sequence_parallel=p.sequence_parallel, sharding=p.data_sharding,
                  **expert_layout(recipe)).describe()


def _nothing_fits(recipe: Recipe, plan: Any, want: dict[str, Any]) -> PreflightError:
    where = f"{plan.nodes} x {plan.gpus_per_node} {plan.gpu.name}"
    least = min(plan.candidates, key=lambda c: c.memory.needed_gib())
    if want and plan.best is not None:
        return PreflightError(
            f"parallel: auto: no layout with the pinned {', '.join(f'{k}={v}' for k, v in want.items())} fits "
            f"{plan.memory_gib:.0f} GiB per GPU on {where}; the planner's first without the pins: "
            f"{plan.best.layout.describe()} (~{plan.best.memory.needed_gib():.0f} GiB)", field="parallel",
            valid="a layout that fits", fix=f"drop the pins ({SWITCH}) or use more nodes (cluster.nodes)")
    return PreflightError(
        f"parallel: auto: none of the {len(plan.candidates):,} layouts of {recipe.name} fits {plan.memory_gib:.0f} "
        f"GiB per GPU on {where} (the least, {least.layout.describe()}, needs ~{least.memory.needed_gib():.0f} GiB)",
        field="parallel", valid="more GPUs or more memory per GPU",
        fix=f"raise cluster.nodes (megalaunch plan {recipe.name} --nodes N) or use a GPU with more memory")


def with_layout(recipe: Recipe, tree: dict[str, Any], prov: dict[str, str]) -> tuple[Recipe, LayoutChoice]:
    """`resolve_layout`, with the chosen values and their origin written into the loader's `tree` and `prov`."""
    recipe, chosen, choice = resolve_layout(recipe, prov)
    values = layout_values(recipe)
    for dotted, origin in chosen.items():
        section, name = dotted.split(".")
        tree.setdefault(section, {})[name] = values[dotted]
        prov[dotted] = origin
    return recipe, choice
