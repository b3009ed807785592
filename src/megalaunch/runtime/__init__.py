"""Code that runs inside the job. Small, explicit, rank-aware; imports nothing from the CLI, config or
launcher, and nothing heavy at import time (torch and Megatron are imported inside functions).

Here: the entry points and the composition, `train` (one rank's trainer, `python -m
megalaunch.runtime.train`), `task` (the supervisor every rank runs under, `python -m
megalaunch.runtime.task`), `hangwatch` (the hang killer outside Python beside the step, `megalaunch job
watch`), `session` (the rooms composed for one segment) and `bytecode`. The parts,
each a sub-package whose docstring says what it owns and what it may use (tests/unit/test_architecture.py
holds the rules, docs/architecture.md draws them):

    loop         Megatron's loop: seams, patches, one step          uses rank, stop, model, flows
    stop         the stop signal, decisions, the signal window        uses rank, observation
    observation  timeline, progress, metrics, W&B, eval queue         uses rank, checkpoint, health
    checkpoint   what to load, around every save, retention           uses rank
    health       health check, stragglers, heartbeat, hangs           uses rank
    model        layer specs, kernels, CPU accommodations             uses rank
    flows        custom training steps, chat data, DPO                uses rank, scoring
    scoring      frozen models' scores stored beside the data         uses rank
    rank         this rank, settings, hooks, collectives, failures    uses nothing of the runtime
"""
