"""What a segment reports about itself, none of which may take training down: the room (`observe`:
progress, metrics, the health check's and stragglers' records, W&B), the segment's timeline of phases
(`timeline`, read by goodput), one W&B run per chain (`wandb_run`), the start-up profile
(`startup_profile`), and rank 0's queue of milestone evaluations (`eval_queue`).

May use: runtime.rank, runtime.checkpoint, runtime.health."""
