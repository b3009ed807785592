"""Is this node, this rank, this step alive and well: the health check at segment start (`health`),
stragglers (`stragglers`), rank 0's sign of life (`heartbeat`), the hang watchdog in Python (`watchdog`),
and the processes of the node read from /proc (`procs`). "What happens when a node dies or hangs" starts
here; the hang killer outside Python that watches the heartbeat is runtime/hangwatch.py, an entry point.

May use: runtime.rank."""
