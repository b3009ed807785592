"""The ground floor: every file of a run directory (paths, atomic writes, the ledger, triggers,
progress and outcome, access, the run registry, tokenization run directories). Imports nothing of
megalaunch but the error types (docs/architecture.md)."""
