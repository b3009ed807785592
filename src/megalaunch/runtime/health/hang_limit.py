"""The hang limits that follow the measured step (docs/training.md, "Hangs"). Standard library only: the
in-Python watchdog (watchdog.py) and the hang watcher outside Python (runtime/hangwatch.py) both use it.

`chain.hang_timeout_s: auto` (the default): after the first iteration (compilation, warm-up) and
MEASURED_ITERATIONS more, no progress for max(K_STEPS x the longest step measured + the save allowance,
HANG_FLOOR_S) is a hang. The save allowance is checkpoint.save_time_estimate_s, or SAVE_FACTOR x the longest
save measured when that is more. Until the step is measured: FALLBACK_S, the former default.

K_STEPS = 10: a step is the longest measured so far (not a mean), and what is not a step (a log interval's
W&B flush, a garbage collection, a data loader refilling, a straggler) must not look like a hang; ten steps
of silence is still minutes less than the former 30 when a step takes seconds. Evaluations during training
(training.eval_iters > 0) beat nowhere: one longer than K_STEPS steps needs an explicit hang_timeout_s.

`chain.startup_timeout_s: auto`: STARTUP_FACTOR x the longest start-up measured in the chain's earlier
segments that resumed from a checkpoint (the first segment loads none, so its start-up says nothing about a
load), at least STARTUP_FLOOR_S; FALLBACK_S when none is known. An explicit number always wins."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

AUTO = "auto"
FALLBACK_S = 1800.0  # auto, before anything is measured
K_STEPS = 10
HANG_FLOOR_S = 120.0
MEASURED_ITERATIONS = 3  # after the first one
SAVE_FACTOR = 2.0
STARTUP_FACTOR = 3.0
STARTUP_FLOOR_S = 300.0
ADOPT_GROWTH = 0.1  # a measured limit is adopted (and recorded) when it moves by more than 10 %


def is_auto(value: object) -> bool:
    return value is None or value == AUTO


def configured_s(value: float | str | None) -> float:
    """The number a reader that does not measure uses: the explicit value, else FALLBACK_S."""
    return FALLBACK_S if is_auto(value) else float(value)  # type: ignore[arg-type]


def hang_limit_s(step_s: float, save_allowance_s: float) -> float:
    return max(K_STEPS * step_s + save_allowance_s, HANG_FLOOR_S)


def save_allowance_s(longest_save_s: float | None, estimate_s: float) -> float:
    return max(estimate_s, SAVE_FACTOR * longest_save_s) if longest_save_s else estimate_s


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
    """Step and save times measured from the beats, on the caller's clock. A step is the time between two
    iteration beats with nothing else between them, per iteration; the first iteration beat only starts
    the measure (its own time includes compilation)."""

    def __init__(self) -> None:
        self.measured = 0  # iterations measured
        self.longest_step_s: float | None = None
        self.longest_save_s: float | None = None
        self._last: tuple[float, int | None] | None = None
        self._save_begun: float | None = None

    def iteration(self, now: float, iteration: int | None) -> None:
        if self._last is not None:
            then, before = self._last
            steps = iteration - before if iteration is not None and before is not None else 1
            if steps > 0 and now > then:
                self.measured += steps
                step = (now - then) / steps
                self.longest_step_s = max(self.longest_step_s or 0.0, step)
        self._last = (now, iteration)

    def save_started(self, now: float) -> None:
        self._save_begun, self._last = now, None

    def save_ended(self, now: float) -> None:
        if self._save_begun is not None:
            self.longest_save_s = max(self.longest_save_s or 0.0, now - self._save_begun)
        self._save_begun, self._last = None, None

    def other(self) -> None:
        """Any other beat: the next interval is not one step."""
        self._last = None

    @property
    def step_s(self) -> float | None:
        return self.longest_step_s if self.measured >= MEASURED_ITERATIONS else None


class HangLimit:
    """The in-Python limit after the first iteration: the explicit `hang_timeout_s`, or (auto) the fallback
    until the step is measured, then the measured rule. `update()` says whether the adopted value moved."""

    def __init__(self, configured: float | str | None, save_estimate_s: float = 60.0) -> None:
        self.auto = is_auto(configured)
        self.save_estimate_s = save_estimate_s
        self.progress = Progress()
        self.value = configured_s(configured)
        self.why = f"auto: step not measured yet, {FALLBACK_S:g} s" if self.auto else "chain.hang_timeout_s"
        self.measured = False

    def update(self) -> bool:
        if not self.auto or (step := self.progress.step_s) is None:
            return False
        save = save_allowance_s(self.progress.longest_save_s, self.save_estimate_s)
        new = hang_limit_s(step, save)
        if self.measured and abs(new - self.value) <= ADOPT_GROWTH * self.value:
            return False
        self.value, self.measured = new, True
        self.why = (f"auto: max({K_STEPS} x step {step:.3g} s + save allowance {save:.3g} s, {HANG_FLOOR_S:g} s)")
        return True

    def record(self) -> dict[str, Any]:
        return {"hang_s": round(self.value, 3), "why": self.why, "step_s": self.progress.step_s,
                "save_s": self.progress.longest_save_s, "save_estimate_s": self.save_estimate_s}
