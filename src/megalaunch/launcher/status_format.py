"""How `megalaunch status RUN` prints what `status.run_status` gathered: the chain's state and why, the
progress and the pace, goodput and MFU, triggers, the guard, the ledger's history (status_history.py),
the checkpoints' disk, and one line per segment."""

from __future__ import annotations

from typing import Any


def format_run_status(st: dict[str, Any]) -> str:
    from megalaunch.launcher.accounting.storage import format_usage  # not imported for a listing of runs
    from megalaunch.launcher.status_history import format_resume

    lines = [f"run {st['chain_name']}  ({st['backend']})  {st['run_dir']}",
             f"  chain: {st['chain_state']}" + (f" - {st['stop_reason']}" if st["stop_reason"] else "")]
    lines += ([f"  fix: {st['stop_fix']}"] if st.get("stop_fix") else []) + vanished_lines(st.get("vanished"), st["run_dir"])
    it = st["iteration"]
    lines.append(f"  iteration: {it if it is not None else '-'} / {st['target']}   last checkpoint: "
                 f"{st['last_checkpoint'] if st['last_checkpoint'] is not None else '-'}"
                 + (f"   tokens/s: {st['tokens_per_s']:.0f}" + (" (run average)" if st.get("tokens_per_s_over") == "run"
                                                             else "") if st["tokens_per_s"] else "")
                 + (f"   loss: {st['loss']:.4g}" if isinstance(st["loss"], (int, float)) else ""))
    lines += flow_lines(st)
    if st.get("goodput") is not None:
        mfu = f"   MFU: {st['mfu']:.1%}" if st.get("mfu") is not None else ""
        from megalaunch.config.planner.forecast import duration

        eta = f"   ETA: {duration(st['eta_s'])} of training" if st.get("eta_s") else ""
        lines.append(f"  goodput so far: {st['goodput']:.1%} of {st['wall_h']:.2f} h allocated "
                     f"({st['startup_share']:.0%} start-up, {st['save_share']:.0%} saving, "
                     f"{st['lost_share']:.0%} lost work){mfu}{eta}   details: megalaunch report RUN")
    if st.get("forecast"):
        lines.append(forecast_line(st["forecast"]))
    lines.append(f"  triggers pending: {', '.join(st['pending_triggers']) or 'none'}   consumed: {st['consumed_triggers']}")
    for r in st.get("refused_triggers") or []:
        lines.append(f"  refused trigger '{r['name']}' planted by {r['planted_by']}: {r['why']} (ignored)")
    g = st["last_guard"]
    if g:
        lines.append(f"  last guard decision: {g['decision']} ({g['failures']}/{g['budget']} segments without "
                     "a new checkpoint)")
    if st["slurm_error"]:
        lines.append(f"  slurm: {st['slurm_error']}")
    lines += _watch_lines(st)
    lines += moe_lines(st.get("moe")) + format_usage(st.get("storage"))
    lines += format_resume(st.get("resume"))
    lines.append("  segments:")
    for r in st["segments"]:
        span = ""
        if r["start_iteration"] is not None or r["end_iteration"] is not None:
            span = f"  iter {r['start_iteration'] if r['start_iteration'] is not None else 0} -> {r['end_iteration'] if r['end_iteration'] is not None else '...'}"
        lines.append(f"    {r['segment']:>3}  {r['job_id']:<12} {r['state']:<10}{span}"
                     + (f"  ({r['reason']})" if r["reason"] else ""))
    exported = st.get("exported")
    if exported:
        lines.append(f"  Hugging Face model: {exported['output']} (iteration {exported.get('iteration')})"
                     if exported.get("ok") else f"  Hugging Face export failed: {exported.get('error')}; retry: "
                     f"{exported.get('fix')}")
    if st.get("next"):
        lines.append(f"  next: {st['next']}")
    return "\n".join(lines)


def vanished_lines(v: dict[str, Any] | None, run_dir: str) -> list[str]:
    """The chain's newest job that died before megalaunch started in it (status._vanished): which, Slurm's
    state, the end of its log, and what to do."""
    if not v:
        return []
    lines = [f"  segment {v['segment']} (job {v['job_id']}) ended before megalaunch started in it "
             f"(Slurm: {v['slurm_state'] or 'state unknown'}); nothing queues the next segment"]
    if v["log_tail"]:
        lines.append(f"  its log ({v['log']}) ends:")
        lines += [f"    | {line}" for line in v["log_tail"]]
    else:
        lines.append(f"  no log at {v['log']}")
    import shlex

    lines.append(f"  fix: the cause in its log, then: megalaunch resume {shlex.quote(run_dir)}")
    return lines


def short_duration(seconds: float | None) -> str:
    """A measured or predicted duration as a person reads it: '0.25 s', '13.9 s', '120 s', '2 min', '2 min 30 s',
    '1 h 5 min' (never '1.2e+02 s')."""
    from megalaunch.config.planner.forecast import duration

    if seconds is None or seconds != seconds:  # None or NaN
        return "-"
    if seconds < 1:
        return f"{max(seconds, 0.0):.2f} s"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    return duration(seconds)



def _watch_lines(st: dict[str, Any]) -> list[str]:
    """What the job's watchers said: nodes, in-job restarts, health checks, stragglers, the stop signal, the
    hang limits in force."""
    out: list[str] = []
    for line in st.get("nodes") or []:
        out.append(f"  nodes: {line}")
    for line in st.get("restarts") or []:
        out.append(f"  in-job restart: {line}")
    for line in st.get("health") or []:
        out.append(f"  health check: {line}")
    for line in st.get("stragglers") or []:
        out.append(f"  stragglers: {line}")
    for line in st.get("stop_signal") or []:
        out.append(f"  stop signal: {line}")
    lim = st.get("hang_limits")
    if lim:  # runtime/hangwatch.record_limits: the newest segment's effective limits
        out.append(f"  hang limits: start-up {lim['startup_s']:g} s ({lim['startup_why']}), then {_hang_limits(lim)}")
    return out


def _hang_limits(lim: dict[str, Any]) -> str:
    """The in-Python limits (they act first), per phase when they differ: between saves, during a save (until
    its checkpoint is written), during an evaluation."""
    between = lim.get("in_python_s") or lim["hang_s"]
    save, evaluation = lim.get("in_python_save_s") or between, lim.get("in_python_eval_s") or between
    if save == between and evaluation == between:
        return f"{between:g} s without progress ({lim['hang_why']})"
    return (f"without progress {between:.0f} s between saves, {save:.0f} s during a save, {evaluation:.0f} s during "
            f"an evaluation ({lim['hang_why']})")

def forecast_line(fc: dict[str, Any]) -> str:
    """The way to the target, from the run's measured figures (launcher/accounting/forecast.py)."""
    from megalaunch.config.planner.forecast import duration
    if fc.get("reached"):
        return f"  forecast: iteration {fc['target']} reached"
    if fc.get("seconds_left") is None:
        return (f"  forecast: none: a segment has no room for an iteration of {short_duration(fc['step_s'])} "
                "(raise cluster.time)")
    more = fc["segments_left"]
    segs = (f"this segment, then {more} more" if fc["running"] else f"{more} more segment{'s' if more != 1 else ''}")
    total = fc["segments_done"] + more
    measured = [k for k, v in fc["source"].items() if str(v).startswith("measured")]
    planned = f", {short_duration(fc['predicted_step_s'])} predicted" if fc.get("predicted_step_s") else ""
    return (f"  forecast: {duration(fc['seconds_left'])} more to iteration {fc['target']} ({segs}; {total} in all), "
            + (f"{fc['gpu_hours_left']:,.1f} GPU-hours more, {fc['gpu_hours_spent'] + fc['gpu_hours_left']:,.1f} in all; "
               if fc.get("gpus") else "a CPU job; ") +
            f"step {short_duration(fc['step_s'])}{planned}, start-up {short_duration(fc['startup_s'])}, "
            f"stop save {short_duration(fc['stop_save_s'])}, periodic save {short_duration(fc['periodic_save_s'])} "
            f"(measured: {', '.join(measured) or 'nothing yet'}; the rest as predicted at submit)")


def moe_lines(moe: dict[str, Any] | None) -> list[str]:
    """An MoE run's expert load (runtime/observation/moe_balance.py): the worst layer of the latest log
    interval, the aux losses, the dropped tokens, and each collapsing router by name; nothing for a dense run."""
    if not moe:
        return []
    s = moe["latest"]
    even = f", even {s['even_share']:.1%}" if s.get("even_share") is not None else ""
    line = f"  experts (iteration {s['iteration']}): "
    line += (f"worst layer {s['worst_layer']}, max/mean {s['max_over_mean']:.2f} (expert {s['hot_expert']} took "
             f"{s['hot_share']:.1%} of the tokens{even})" if s.get("worst_layer") is not None else "no tokens routed")
    line += "".join(f"   {name} {value:.4g}" for name, value in sorted(s["aux"].items()))
    if s.get("dropped_share"):
        line += f"   dropped {s['dropped_share']:.1%} of routed tokens"
    lines = [line]
    for c in moe["collapsing"]:
        lines.append(f"  router collapsing: layer {c['layer']}: expert {c['expert']} took {c['share']:.0%} of the "
                     f"tokens (even {c['even']:.1%}) for {c['intervals']} log intervals, since iteration {c['since']}"
                     " (raise model.moe_aux_loss_coeff, or lower the learning rate)")
    return lines


def flow_lines(st: dict[str, Any]) -> list[str]:
    """A flow's own metrics at the last log step (DPO's rewards, GRPO's reward, KL and clip fraction,
    distillation's KL: whatever names the flow reports), and DPO's reference scoring when it ran."""
    out = []
    flow = st.get("flow")
    if isinstance(flow, dict) and flow:
        out.append("  flow: " + "   ".join(f"{k}: {v:.4g}" for k, v in sorted(flow.items())
                                           if isinstance(v, (int, float))))
    ref = st.get("reference")
    if isinstance(ref, dict) and ref.get("event") == "reference":  # online, or a scoring not finished yet
        out.append(f"  reference: {ref.get('choice')} ({ref.get('why')})")
    elif isinstance(ref, dict):
        docs = sum(v for v in (ref.get("documents") or {}).values() if isinstance(v, int))
        out.append(f"  reference: {docs:,} documents scored in {ref.get('seconds', 0):.0f} s "
                   f"({ref.get('tokens_per_s', 0):,.0f} tokens/s) -> RUN/scores/reference")
    return out
