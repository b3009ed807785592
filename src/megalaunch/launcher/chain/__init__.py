"""The self-requeuing chain: a segment's begin and end and the chain's decision (`chain`), a segment's
fate and what every end cleans up (`segment_end`), queueing the successor (`successor`), the suspect
nodes it records and excludes (`suspects`), the protocol every backend implements (`backend`), a rank's
restart inside the job (`restart`), who is told when the chain stops (`notify`), a conversion as the
chain's first stage (`first_stage`), and `resume --from` (`resume_from`).

May use: launcher.accounting, launcher.prepare, config, runtime, rundir."""
