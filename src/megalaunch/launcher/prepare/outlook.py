"""What `submit` says of the layout it chose (`parallel: auto`, config/planner/auto.py) and of the time and cost
to the target (config/planner/forecast.py), and what it records of both in RUN/plan.json, from which
`status` compares the measured figures with the predicted ones (launcher/accounting/forecast.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from megalaunch.config.planner.auto import SWITCH, LayoutChoice
from megalaunch.config.planner.forecast import (
    Forecast,
    Limits,
    Overheads,
    duration,
    forecast,
    predicted_overheads,
)
from megalaunch.config.schema import Recipe


@dataclass(frozen=True)
class Outlook:
    layout: LayoutChoice | None
    overheads: Overheads
    limits: Limits
    forecast: Forecast | None
    target: int
    auto_requeue: bool = True

    def record(self) -> str:
        """RUN/plan.json: the choice and its inputs, the predicted figures and the forecast at submit."""
        return json.dumps({"layout": self.layout.record() if self.layout else None,
                           "overheads": asdict(self.overheads), "limits": asdict(self.limits),
                           "forecast": self.forecast.record() if self.forecast else None,
                           "target": self.target}, indent=2, sort_keys=True) + "\n"


def outlook(recipe: Recipe, layout: LayoutChoice | None, checkpoint_bytes: int | None) -> Outlook:
    step = layout.predicted["step_s"] if layout is not None and layout.predicted else None
    o = predicted_overheads(recipe, step, checkpoint_bytes)
    lim = Limits.of(recipe)
    return Outlook(layout, o, lim, forecast(o, lim, recipe.training.train_iters), recipe.training.train_iters,
                   recipe.chain.auto_requeue)


def layout_lines(choice: LayoutChoice | None, *, why: bool) -> list[str]:
    """One line of the layout that runs (submit: when the planner chose it or has a word on it); the dry run
    adds why, what was pinned and the runner-up."""
    if choice is None:
        return []
    lines = []
    p, inputs = choice.predicted, choice.inputs
    where = f"{inputs['nodes']} x {inputs['gpus_per_node']} {inputs['gpu']}" if inputs else ""
    if choice.planned and p:
        lines.append(f"layout: {choice.layout} (parallel: auto): predicted {p['step_s']:.3g} s per step, "
                     f"{p['memory_gib']:.1f} of {inputs['memory_gib']:.0f} GiB per GPU, {p['tokens_per_s']:,.0f} "
                     f"tokens/s per GPU ({p['mfu']:.0%} MFU) on {where}")
    elif why or (choice.mode == "auto" and not choice.reason.startswith("as written: a CPU job")
                 and not choice.reason.startswith("as written: a workload")):
        lines.append(f"layout: {choice.layout}, {choice.reason}"
                     + (f": predicted {p['step_s']:.3g} s per step, {p['memory_gib']:.1f} GiB per GPU on {where}"
                        if p else ""))
    if choice.warn and choice.first:
        first = choice.first
        assert p is not None and choice.slower is not None
        pins = ", ".join(f"{k} from {origin}" for k, (_, origin) in choice.pinned.items()) or "parallel.layout: pinned"
        lines.append(f"layout: this layout is predicted {choice.slower:.0%} slower than the planner's first, "
                     f"{first['layout']} ({p['step_s']:.3g} vs {first['step_s']:.3g} s per step; pinned: {pins}); "
                     f"to use it: {SWITCH}")
    if why and choice.planned:
        nxt = choice.runner_up
        lines.append(f"  why: {choice.reason} ({choice.considered:,} layouts of {inputs['model']}, seq "
                     f"{inputs['seq_length']}, global batch {inputs['global_batch_size']} on {where}, ranked by "
                     f"predicted step time: megalaunch plan)"
                     + (f"; next: {nxt['layout']}, {nxt['step_s']:.3g} s" if nxt else ""))
        if choice.pinned:
            lines.append("  pinned: " + ", ".join(f"{k}={v} ({origin})" for k, (v, origin) in choice.pinned.items()))
    return lines


def forecast_lines(o: Outlook, *, why: bool) -> list[str]:
    """Time to the target, segments and GPU-hours; the dry run adds the figures it rests on."""
    f, lim, ov = o.forecast, o.limits, o.overheads
    if f is None:
        return [f"forecast: none: a segment of {duration(lim.time_limit_s)} has no room for an iteration of "
                f"{ov.step_s:.3g} s after its start-up and before the stop signal (raise cluster.time)"]
    cost = f"{f.gpu_hours:,.1f} GPU-hours on {lim.gpus} GPUs" if lim.gpus else "a CPU job: no GPU-hours"
    line = (f"forecast: {duration(f.seconds)} to iteration {o.target} in {f.segments} segment"
            f"{'s' if f.segments != 1 else ''} of at most {duration(lim.time_limit_s)} (~{f.per_segment:,} iterations "
            f"each), {cost}; queue waits not counted")
    if not o.auto_requeue and f.segments > 1:
        line += "; chain.auto_requeue is off: each further segment needs megalaunch resume"
    lines = [line]
    if why:
        src = ov.source
        lines.append(f"  from: step {ov.step_s:.3g} s ({src.get('step')}), a periodic save {ov.periodic_save_s:.3g} s "
                     f"every {lim.save_interval} iterations; start-up {ov.first_startup_s:.0f} s, then "
                     f"{ov.startup_s:.0f} s ({src.get('start-up')}); stop save {ov.stop_save_s:.0f} s "
                     f"({src.get('saves')}); the stop signal {lim.time_limit_s - lim.stop_at_s:.0f} s before the limit")
    return lines


def outlook_lines(outlook_: Outlook | None, *, why: bool) -> list[str]:
    if outlook_ is None:
        return []
    return [*layout_lines(outlook_.layout, why=why), *forecast_lines(outlook_, why=why)]

