"""Recipes: typed schema, loading/composition/overrides with provenance, preflight checks, Megatron's
argument list; `planner/` predicts memory, checkpoint bytes and step time for layouts."""
