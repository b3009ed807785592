"""What happened to a run, read from its files: where each segment's time went (`goodput`), which rank
and node ended a segment first (`evidence`), the team's suspect nodes (`nodes`), and the checkpoints'
disk plan against the filesystem's free space and quota (`storage`).

May use: config, runtime, rundir; no other part of the launcher."""
