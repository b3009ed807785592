"""Boundary gates: a part of the step that must agree, at a step boundary, that the next iteration can
start (GRPO's rollout feed: is the next round there? runtime/flows/rollout_feed.py). The stop decision
(runtime/stop/decisions.py) asks every gate at every boundary, on every rank, before its own check; a gate
that says stop has written its `exit` trigger with the reason (rank 0), and the decision is then taken at
this boundary whatever trigger_interval says (every rank reached the same boundary), so Megatron saves and
leaves with outcome `exited`. A gate is the same function on every rank and answers the same on every rank."""

from __future__ import annotations

from collections.abc import Callable

Gate = Callable[[int], bool]  # the iteration just completed -> True: stop before the next one
_GATES: list[Gate] = []


def add_gate(gate: Gate) -> None:
    _GATES.append(gate)


def clear_gates() -> None:
    _GATES.clear()


def gates_say_stop(iteration: int) -> bool:
    """Ask every gate (all of them, in order: each may have to wait for its state)."""
    return any([gate(iteration) for gate in _GATES])  # a list: every gate runs, not only up to the first
