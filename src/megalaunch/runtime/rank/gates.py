"""Boundary gates: a part of the step that must agree, at a step boundary, that the next iteration can
start (GRPO's rollout feed: is the next round there? runtime/flows/rollout_feed.py). The stop decision
(runtime/stop/decisions.py) asks every gate at every boundary, on every rank, before its own check. A gate
answers True to have the decision taken at this boundary whatever trigger_interval says (every rank reached
the same boundary and gets the same answer): when it stops the segment (rank 0 has written its `exit` trigger
with the reason, so Megatron saves and leaves with outcome `exited`), and when its wait was cut short by the
stop signal (`interrupted()`: this rank's signal flag), so that the signal's save comes now, not after a wait
that may outlast the job's time limit."""

from __future__ import annotations

from collections.abc import Callable

Gate = Callable[[int, Callable[[], bool]], bool]  # (iteration just completed, interrupted) -> decide now
_GATES: list[Gate] = []


def add_gate(gate: Gate) -> None:
    _GATES.append(gate)


def clear_gates() -> None:
    _GATES.clear()


def gates_say_decide(iteration: int, interrupted: Callable[[], bool] = lambda: False) -> bool:
    """Ask every gate (all of them, in order: each may have to wait for its state)."""
    return any([gate(iteration, interrupted) for gate in _GATES])  # a list: every gate runs, not only the first
