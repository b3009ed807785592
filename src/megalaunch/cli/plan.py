"""`megalaunch plan RECIPE`: the valid layouts ranked by predicted speed, with their memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from megalaunch.cli.options import ClusterOpt, SetOpt
from megalaunch.cli.output import say

if TYPE_CHECKING:
    from megalaunch.config.planner.plan import Candidate, Plan


def plan(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes (default: the recipe's cluster.nodes).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node (default: the recipe's).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU type, e.g. H100, H200, A100-40GB (default: cluster.gpu).")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Layouts to show.")] = 15,
    apply: Annotated[bool, typer.Option("--apply", help="Print the --set lines of the first layout (or write a "
                                        "recipe with --write).")] = False,
    write: Annotated[Path | None, typer.Option("--write", help="With --apply: write a recipe including RECIPE with "
                                               "the first layout to this file.")] = None,
    set_: SetOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Rank the recipe's valid layouts (TP, PP, VPP, CP, micro-batch, SP, recompute, data sharding) by
    predicted tokens/s."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.planner.checkpoint_size import peak_lines, recipe_peak
    from megalaunch.config.planner.plan import plan_recipe, set_lines
    from megalaunch.config.preflight import tokenizer_vocab_size
    from megalaunch.errors import PreflightError

    loaded = load_recipe(recipe, list(set_ or []), cluster=cluster, plan_layout=False)  # it ranks them all itself
    result = plan_recipe(loaded.recipe, tokenizer_vocab_size(loaded.recipe), nodes=nodes,
                         gpus_per_node=gpus_per_node, gpu=gpu)
    if apply:
        if result.best is None:
            raise PreflightError(f"no layout of {loaded.recipe.name} fits {result.memory_gib:.0f} GiB per GPU",
                                 field="--nodes", valid="more GPUs", fix="raise --nodes or use a GPU with more memory")
        if write is not None:
            write.write_text(recipe_text(recipe, result))
            say(f"wrote {write}: megalaunch submit {write}")
            return
        say(" ".join(f"--set {line}" for line in set_lines(result.best.layout)))
        return
    fitting = sum(c.fits for c in result.candidates)
    say(f"{loaded.recipe.name} on {result.nodes} x {result.gpus_per_node} {result.gpu.name} "
        f"({result.memory_gib:.0f} GiB each): {len(result.candidates)} layouts, {fitting} fit")
    for line in peak_lines(recipe_peak(loaded.recipe, tokenizer_vocab_size(loaded.recipe))):
        say(line.replace("checkpoint:", "checkpoint (any layout):", 1))
    first = result.candidates[0].layout
    counted = [what for what, on in (("liger-kernel's fused loss at TP 1", first.fused_loss),
                                     ("the grouped experts' fused dispatch", first.grouped_experts)) if on]
    if counted:
        say(f"memory with {' and '.join(counted)} (training.kernels: {loaded.recipe.training.kernels}; the job "
            "refuses a node without them where its layout fits only with them)")
    if first.etp is not None and not first.grouped_experts:  # an MoE model on Megatron's SequentialMLP
        say("speed: the step times assume megalaunch's grouped experts, which this GPU or recipe does not get "
            "(compute capability 9.0+ and training.kernels auto|liger): Megatron's SequentialMLP runs instead, measured "
            "x2-x5 slower a step on an H200 (docs/moe.md)")
    for line in table(result.candidates, top):
        say(line)
    if result.best is not None:
        say(f"apply the first: megalaunch plan {recipe} --apply  (or --apply --write my-recipe.yaml)")


def register(app: typer.Typer) -> None:
    app.command()(plan)


def table(cands: list[Candidate], top: int) -> list[str]:
    lines = [f"{'#':>3} {'layout':<52} {'memory':>9} {'step s':>7} {'tokens/s/GPU':>12} {'TFLOP/s':>8}  "
             "time: compute/tp/pp/dp"]
    for i, c in enumerate(cands[:top], 1):
        p = c.parts
        lines.append(f"{i:>3} {c.layout.describe():<52} {c.memory.needed_gib():>6.1f} GiB {c.step_s:>7.2f} "
                     f"{c.tokens_per_s:>12,.0f} {c.tflops:>8.0f}  {p['compute']:.2f}/{p['tp']:.2f}/"
                     f"{p['pp_bubble']:.2f}/{p['dp'] + p['optimizer']:.2f}"
                     + (f" +{p['ep']:.2f} all-to-all" if p.get("ep") else "")
                     + (f" +{p['memory_pressure']:.2f} memory pressure" if p.get("memory_pressure") else "")
                     + ("" if c.fits else "  (does not fit)"))
    return lines


def recipe_text(source: str, plan: Plan) -> str:
    """A recipe that includes `source` with the plan's first layout (for `plan --apply --write FILE`)."""
    from megalaunch.config.planner.plan import set_lines

    assert plan.best is not None
    c = plan.best
    lines = [f"# {plan.recipe_name}, ranked first by `megalaunch plan` for {plan.nodes} x {plan.gpus_per_node} "
             f"{plan.gpu.name}:", f"# {c.layout.describe()}: ~{c.memory.needed_gib():.0f} GiB per GPU, "
             f"~{c.tokens_per_s:,.0f} tokens/s per GPU predicted", f"include: [{source}]",
             "cluster:", f"  nodes: {plan.nodes}", f"  gpus_per_node: {plan.gpus_per_node}", f"  gpu: {plan.gpu.name}"]
    sections: dict[str, list[str]] = {}
    for line in set_lines(c.layout):
        key, value = line.split("=", 1)
        section, field = key.split(".")
        sections.setdefault(section, []).append(f"  {field}: {value}")
    for section, items in sections.items():
        lines += [f"{section}:", *items]
    return "\n".join(lines) + "\n"
