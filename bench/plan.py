"""The planner's ranking next to measured tokens/s: `megalaunch plan`'s top layouts, each trained.

    PYTHONPATH=src python bench/plan.py --recipe train/llama3-8b --gpus 2 --gpu H100 \
        --set model.num_layers=8 --set training.global_batch_size=8 --top 4

The plan is made for one node of `--gpus` GPUs of type `--gpu` (the device's: memory and speed), over
the layouts that fit; the first `--top` distinct layouts (plus `--also` picks by rank) are trained a
few iterations each with bench/memory_calib.py's runner. Prints rank, predicted and measured tokens/s
per GPU, estimated and measured memory; writes OUT/plan_bench.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_calib as calib  # bench/: it puts src/ on the path and takes bench/ off again


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="train/llama3-8b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--also", default="", help="more ranks to measure, e.g. 8,20")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--families", action="store_true",
                        help="measure the best-ranked layout of each split (TP, PP, VPP, CP), not only the top ranks")
    parser.add_argument("--dry-run", action="store_true", help="print the ranking and the cases; train nothing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "plan_bench")
    a = parser.parse_args()
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.planner.plan import plan_recipe, set_lines

    sets = [*calib.BASE, "cluster.nodes=1", f"cluster.gpus_per_node={a.gpus}", *a.set]
    recipe = load_recipe(a.recipe, sets, cluster="local").recipe
    result = plan_recipe(recipe, recipe.data.vocab_size, nodes=1, gpus_per_node=a.gpus, gpu=a.gpu)
    fitting = [c for c in result.candidates if c.fits]
    picks, seen = [], set()
    for i, c in enumerate(fitting, 1):  # distinct in what changes speed: SP alone only saves memory
        key = (c.layout.tp, c.layout.pp, c.layout.vpp, c.layout.cp, c.layout.micro_batch, c.layout.recompute)
        if key not in seen:
            seen.add(key)
            picks.append((i, c))
    distinct = list(picks)
    if a.families:  # the planner's best of each split (TP, PP, VPP, CP) first, then the next ranks
        best_of: dict[tuple[object, ...], tuple[int, object]] = {}
        for i, c in picks:
            best_of.setdefault((c.layout.tp, c.layout.pp, c.layout.vpp, c.layout.cp), (i, c))
        heads = list(best_of.values())
        picks = sorted(heads + [p for p in picks if p not in heads][:max(0, a.top - len(heads))], key=lambda p: p[0])
    chosen = picks[:a.top] + [p for p in distinct if str(p[0]) in a.also.split(",") and p not in picks[:a.top]]
    cases = {f"plan-{i}": (a.recipe, a.gpus, [*a.set, *set_lines(c.layout)]) for i, c in chosen}
    for i, c in chosen:
        print(f"rank {i:>3}: {c.layout.describe():<50} predicted {c.tokens_per_s:,.0f} tokens/s/GPU, "
              f"~{c.memory.total / 2**30:.1f} GiB", flush=True)
    if a.dry_run:
        return 0
    import torch

    a.out.mkdir(parents=True, exist_ok=True)
    rows = calib.run_cases(list(cases), a.out, a.iters, torch.cuda.device_count(), 300, cases=cases)
    tokens_per_step = recipe.training.global_batch_size * recipe.model.seq_length
    print(f"\n== plan vs measured: {a.recipe} {' '.join(a.set)} on {a.gpus} x {torch.cuda.get_device_name()} ==")
    print(f"{'rank':>4} {'layout':<50} {'predicted':>10} {'measured':>10} {'est GiB':>8} {'max GiB':>8}")
    out = []
    for (i, c), row in zip(chosen, sorted(rows, key=lambda r: int(r["case"].split("-")[1])), strict=True):
        measured = tokens_per_step / (row["ms_per_iteration"] / 1000) / a.gpus if "ms_per_iteration" in row else None
        out.append({"rank": i, "layout": c.layout.describe(), "predicted_tokens_per_s": c.tokens_per_s,
                    "measured_tokens_per_s": measured, **row})
        print(f"{i:>4} {c.layout.describe():<50} {c.tokens_per_s:>10,.0f} "
              f"{(f'{measured:,.0f}' if measured else row.get('error', '-')):>10} {row['estimate_gib']:>8.1f} "
              f"{row.get('max_allocated_gib', float('nan')):>8.1f}")
    best = max((r for r in out if r["measured_tokens_per_s"]), key=lambda r: r["measured_tokens_per_s"], default=None)
    if best and out[0]["measured_tokens_per_s"]:
        print(f"top-ranked is {100 * (1 - out[0]['measured_tokens_per_s'] / best['measured_tokens_per_s']):.1f} % "
              f"behind the fastest measured (rank {best['rank']}); acceptance: <= 5 %")
    (a.out / "plan_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
