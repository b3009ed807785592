"""What happened to a run, read from its files: where each segment's time went (`goodput`), which rank
and node ended a segment first (`evidence`), the team's suspect nodes (`nodes`), the checkpoints'
disk plan against the filesystem's free space and quota (`storage`), and how fast the run trains:
tokens/s, MFU, the time left (`pace`).

May use: config, runtime, rundir; no other part of the launcher."""
