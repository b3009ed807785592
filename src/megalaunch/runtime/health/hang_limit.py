"""The hang limits that follow the measured step (docs/training.md, "Hangs"). Standard library only: the
in-Python watchdog (watchdog.py) and the hang watcher outside Python (runtime/hangwatch.py) both use it.

`chain.hang_timeout_s: auto` (the default): the limit depends on what the trainer is doing, after the first
iteration (compilation, warm-up) and MEASURED_ITERATIONS more have been measured (until then FALLBACK_S, the
former default, in every phase):
- between saves (TRAIN): max(K_STEPS x the longest step measured, HANG_FLOOR_S);
- during a save (SAVE: from a save's start until its checkpoint is written, an asynchronous one's too, whose
  wait may block any later point): that + the save allowance, checkpoint.save_time_estimate_s or
  SAVE_FACTOR x the longest save measured (start to complete checkpoint) when that is more;
- during an evaluation (EVAL: Megatron's evaluation during training beats at its start, every eval batch and
  its end): that + the eval allowance, SAVE_FACTOR x the longest silence measured inside an evaluation, or
  EVAL_FALLBACK_S until one evaluation has been measured.
So the saves' allowance no longer inflates the limit between saves, where a frozen rank is most likely.

K_STEPS = 10: a step is the longest measured so far (not a mean), and a straggler's step must not look like a
hang. HANG_FLOOR_S = 45: what runs between two iteration beats without beating of its own, at any step time:
a garbage collection of a large process (seconds), rank 0's progress and metrics files and a W&B log call
(W&B sends from its own process; a stalled flush blocks for seconds), the data loader refilling or a blend's
next shard opened on a shared file system (a stall of a metadata server: tens of seconds), the trigger files
read on rank 0. 45 s is above all of these and lets a frozen rank with 1 s steps be found, its stacks
written, the ranks ended and the segment restarted within 2 minutes (docs/training.md measures it).
EVAL_FALLBACK_S = 300: the first eval batch of a segment may start the validation loader's workers and
build the forward-only graph.

`chain.startup_timeout_s: auto`: STARTUP_FACTOR x the longest start-up measured in the chain's earlier
segments that resumed from a checkpoint (the first segment loads none, so its start-up says nothing about a
load), at least STARTUP_FLOOR_S; FALLBACK_S when none is known. An explicit number always wins and applies
in every phase."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

AUTO = "auto"
FALLBACK_S = 1800.0  # auto, before anything is measured
K_STEPS = 10
HANG_FLOOR_S = 45.0
EVAL_FALLBACK_S = 300.0  # during an evaluation, + this until one has been measured
MEASURED_ITERATIONS = 3  # after the first one
SAVE_FACTOR = 2.0
STARTUP_FACTOR = 3.0
STARTUP_FLOOR_S = 300.0
ADOPT_GROWTH = 0.1  # a measured limit is adopted (and recorded) when it moves by more than 10 %
TRAIN, SAVE, EVAL = "between saves", "during a save", "during an evaluation"
PHASES = (TRAIN, SAVE, EVAL)


def is_auto(value: object) -> bool:
    return value is None or value == AUTO


def configured_s(value: float | str | None) -> float:
    """The number a reader that does not measure uses: the explicit value, else FALLBACK_S."""
    return FALLBACK_S if is_auto(value) else float(value)  # type: ignore[arg-type]


def between_saves_s(step_s: float) -> float:
    return max(K_STEPS * step_s, HANG_FLOOR_S)


def save_allowance_s(longest_save_s: float | None, estimate_s: float) -> float:
    return max(estimate_s, SAVE_FACTOR * longest_save_s) if longest_save_s else estimate_s


def eval_allowance_s(longest_eval_gap_s: float | None) -> float:
    return SAVE_FACTOR * longest_eval_gap_s if longest_eval_gap_s else EVAL_FALLBACK_S


def phase_limits(step_s: float, save_s: float, eval_s: float) -> dict[str, float]:
    """The limit in each phase: between saves, and during a save or an evaluation with its allowance."""
    between = between_saves_s(step_s)
    return {TRAIN: between, SAVE: between + save_s, EVAL: between + eval_s}


def startup_limit(configured: float | str | None, startups: list[float]) -> tuple[float, str]:
    """The start-up limit and why: explicit, measured (earlier segments' start-ups), or the fallback."""
    if not is_auto(configured):
        return float(configured), "chain.startup_timeout_s"  # type: ignore[arg-type]
    if not startups:
        return FALLBACK_S, f"auto: no start-up measured yet, {FALLBACK_S:g} s"
    longest = max(startups)
    return (max(STARTUP_FACTOR * longest, STARTUP_FLOOR_S),
            f"auto: {STARTUP_FACTOR:g} x the longest start-up measured ({longest:.0f} s), at least {STARTUP_FLOOR_S:g} s")


def measured_startups(timeline_dir: Path, current_job: str | None = None) -> list[float]:
    """Seconds from the trainer's start to its first iteration in each earlier segment that resumed from a
    checkpoint (their timelines, runtime/observation/timeline.py); unreadable ones are skipped."""
    out = []
    for path in sorted(timeline_dir.glob("*.json")):
        if path.stem == current_job:
            continue
        try:
            data: Any = json.loads(path.read_text())
            phases = data["phases"]
            end = float(phases["first_iteration_end"])
            start = min(float(v) for k, v in phases.items() if k not in ("first_iteration_end", "last_iteration_end"))
            resumed = int(data.get("start_iteration") or 0) > 0
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if resumed and math.isfinite(end - start) and end > start:
            out.append(end - start)
    return out


class Progress:
    """Step, save and evaluation times measured from the beats, on the caller's clock, and the phase the
    beats say the trainer is in. A step is the time between two iteration beats with nothing else between
    them, per iteration; the first iteration beat only starts the measure (its own time includes
    compilation). A save lasts from its start until its checkpoint is written (an asynchronous one's write
    goes on behind later iterations, any of which may block on it); an evaluation from its start to its end,
    measured by its longest silence between beats."""

    def __init__(self) -> None:
        self.measured = 0  # iterations measured
        self.longest_step_s: float | None = None
        self.longest_save_s: float | None = None
        self.longest_eval_gap_s: float | None = None  # adopted when an evaluation ends
        self._last: tuple[float, int | None] | None = None
        self._saving = False  # a save's blocking part runs
        self._writes: dict[int | None, float] = {}  # saves begun whose checkpoint is not written yet
        self._eval: tuple[float, float] | None = None  # the evaluation running: (its last beat, longest gap)

    def iteration(self, now: float, iteration: int | None) -> None:
        if self._last is not None:
            then, before = self._last
            steps = iteration - before if iteration is not None and before is not None else 1
            if steps > 0 and now > then:
                self.measured += steps
                step = (now - then) / steps
                self.longest_step_s = max(self.longest_step_s or 0.0, step)
        self._last = (now, iteration)

    def save_started(self, now: float, iteration: int | None = None) -> None:
        self._writes.setdefault(iteration, now)
        self._saving, self._last = True, None

    def save_ended(self, now: float, iteration: int | None = None) -> None:
        """The save's blocking part returned (an asynchronous checkpoint may still be written: `written`)."""
        self._took(now, self._writes.get(iteration))
        self._saving, self._last = False, None

    def written(self, now: float, iteration: int | None = None) -> None:
        """The checkpoint of `iteration` is complete (None: every save begun)."""
        for key in [iteration] if iteration is not None else list(self._writes):
            self._took(now, self._writes.pop(key, None))

    def _took(self, now: float, begun: float | None) -> None:
        if begun is not None:
            self.longest_save_s = max(self.longest_save_s or 0.0, now - begun)

    def eval_beat(self, now: float) -> None:
        """An evaluation started, or one of its batches did."""
        last, longest = self._eval if self._eval is not None else (now, 0.0)
        self._eval, self._last = (now, max(longest, now - last)), None

    def eval_ended(self, now: float) -> None:
        if self._eval is not None:
            last, longest = self._eval
            self.longest_eval_gap_s = max(self.longest_eval_gap_s or 0.0, longest, now - last)
        self._eval, self._last = None, None

    def other(self) -> None:
        """Any other beat: the next interval is not one step."""
        self._last = None

    @property
    def phase(self) -> str:
        return EVAL if self._eval is not None else SAVE if self._saving or self._writes else TRAIN

    @property
    def step_s(self) -> float | None:
        return self.longest_step_s if self.measured >= MEASURED_ITERATIONS else None


class HangLimit:
    """The in-Python limits after the first iteration, one per phase: the explicit `hang_timeout_s` in every
    phase, or (auto) the fallback until the step is measured, then the measured rule. `update()` says whether
    the adopted values moved."""

    def __init__(self, configured: float | str | None, save_estimate_s: float = 60.0) -> None:
        self.auto = is_auto(configured)
        self.save_estimate_s = save_estimate_s
        self.progress = Progress()
        self.limits = dict.fromkeys(PHASES, configured_s(configured))
        self.why = f"auto: step not measured yet, {FALLBACK_S:g} s" if self.auto else "chain.hang_timeout_s"
        self.allowances = (save_estimate_s, EVAL_FALLBACK_S)
        self.measured = False

    @property
    def value(self) -> float:
        """The limit between saves (the lowest)."""
        return self.limits[TRAIN]

    def for_phase(self, phase: str | None = None) -> float:
        """The limit in `phase` (None: the phase the beats say)."""
        return self.limits[phase or self.progress.phase]

    def update(self) -> bool:
        if not self.auto or (step := self.progress.step_s) is None:
            return False
        self.allowances = (save_allowance_s(self.progress.longest_save_s, self.save_estimate_s),
                           eval_allowance_s(self.progress.longest_eval_gap_s))
        new = phase_limits(step, *self.allowances)
        if self.measured and all(abs(new[p] - self.limits[p]) <= ADOPT_GROWTH * self.limits[p] for p in PHASES):
            return False
        self.limits, self.measured = new, True
        save, evaluation = self.allowances
        self.why = (f"auto: max({K_STEPS} x step {step:.3g} s, {HANG_FLOOR_S:g} s) between saves, + save allowance "
                    f"{save:.3g} s during a save, + eval allowance {evaluation:.3g} s during an evaluation")
        return True

    def published(self) -> dict[str, Any] | None:
        """What rank 0's heartbeat carries once measured (runtime/observation/timeline.py): the watcher
        outside Python samples the heartbeat and may miss the beats a measure needs; this sees every one."""
        if not (self.auto and self.measured):
            return None
        return {"limits_s": [round(self.limits[p], 3) for p in PHASES], "why": self.why}

    def adopt(self, published: Any) -> None:
        """The watcher outside Python: rank 0's watchdog's limits, where they are above its own measure."""
        try:
            values, why = [float(v) for v in published["limits_s"]], str(published["why"])
        except (TypeError, KeyError, ValueError):
            return
        if len(values) == len(PHASES):
            own = self.limits if self.measured else dict.fromkeys(PHASES, 0.0)
            self.limits = {p: max(v, own[p]) for p, v in zip(PHASES, values, strict=True)}
            self.measured, self.why = True, why

    def describe(self, phase: str | None = None) -> str:
        """Why the limit of `phase` is what it is (in a hang's reason)."""
        phase = phase or self.progress.phase
        if not self.auto or not self.measured:
            return self.why
        step, (save, evaluation) = self.progress.step_s or 0.0, self.allowances
        extra = {TRAIN: "", SAVE: f" + save allowance {save:.3g} s", EVAL: f" + eval allowance {evaluation:.3g} s"}
        return f"auto, {phase}: max({K_STEPS} x step {step:.3g} s, {HANG_FLOOR_S:g} s){extra[phase]}"

    def record(self) -> dict[str, Any]:
        return {"hang_s": round(self.value, 3), "save_hang_s": round(self.limits[SAVE], 3),
                "eval_hang_s": round(self.limits[EVAL], 3), "why": self.why, "step_s": self.progress.step_s,
                "save_s": self.progress.longest_save_s, "save_estimate_s": self.save_estimate_s,
                "eval_gap_s": self.progress.longest_eval_gap_s}


class BeatPhases:
    """The watcher outside Python's view of the phase, from rank 0's latest heartbeat alone (it samples the
    file, so it may miss beats): a save from its start until its checkpoint is written (`writing`: an
    asynchronous one's write goes on behind iterations), an evaluation, or training between saves. Saves
    and evaluations are measured as spells (from the first beat seen in one to the first after it), so a
    beat the watcher did not see changes a measure by one look, never loses it."""

    def __init__(self) -> None:
        self.saving = False
        self.evaluating = False

    @property
    def kind(self) -> str:
        return EVAL if self.evaluating else SAVE if self.saving else TRAIN

    def observe(self, hang: HangLimit | None, now: float, phase: str, beat: dict[str, Any],
                iteration: int | None) -> None:
        """One heartbeat seen (`beat`: its content; `hang_limits`: rank 0's watchdog's, adopted)."""
        saving, evaluating = phase == "save_start" or bool(beat.get("writing")), phase in ("eval_start", "eval")
        if hang is not None:
            p = hang.progress
            if self.saving and not saving:
                p.save_ended(now)
                p.written(now)
            if self.evaluating and not evaluating:
                p.eval_ended(now)
            if saving and not self.saving:
                p.save_started(now)
            if evaluating:
                p.eval_beat(now)
            elif phase in ("iteration", "first_iteration_end"):
                p.iteration(now, iteration)
            else:
                p.other()
            hang.update()
            if beat.get("hang_limits"):
                hang.adopt(beat["hang_limits"])
        self.saving, self.evaluating = saving, evaluating
