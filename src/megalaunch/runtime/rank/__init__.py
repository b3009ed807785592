"""What every part of the runtime shares: this rank in its step (`dist_env`: RANK, WORLD_SIZE and
MASTER_ADDR from Slurm's variables; `context`: the log line and the ledger), the runtime's slice of the
recipe (`settings`: runtime.json), the protocols the loop's seams call (`hooks`), the few collectives
megalaunch adds (`collectives`), what a failure means and whether a retry can fix it (`failures`,
`storage`: a full disk told apart from a node fault), and the faults tests inject (`fault_hooks`).

May use: rundir and the standard library only; every other part of the runtime may use it."""
