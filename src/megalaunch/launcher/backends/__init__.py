"""Where a prepared run executes: Slurm (`slurm`, the one Slurm client with every call timed, and
`slurm_backend`), this machine (`local`: segments in the foreground, a timer for the time limit), and the
one map from `cluster.backend` to code (`registry`).

May use: launcher.chain, launcher.prepare, launcher.accounting, config, runtime, rundir."""
