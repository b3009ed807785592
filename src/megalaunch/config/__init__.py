"""Recipes: typed schema, loading/composition/overrides with provenance, preflight checks."""
