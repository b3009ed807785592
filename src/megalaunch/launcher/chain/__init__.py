"""The self-requeuing chain: a segment's begin and end, its fate and the successor (`chain`), the
protocol every backend implements (`backend`), a rank's restart inside the job (`restart`), who is told
when the chain stops (`notify`), a conversion as the chain's first stage (`first_stage`), and
`resume --from` (`resume_from`).

May use: launcher.accounting, launcher.prepare, config, runtime, rundir."""
