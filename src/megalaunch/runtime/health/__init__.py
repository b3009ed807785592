"""Is this node, this rank, this step alive and well: the health check at segment start (`health`),
stragglers (`stragglers`), rank 0's sign of life (`heartbeat`), every node's sign of life apart from
progress and the silent node it reveals (`node_beat`), a node whose ranks alone did not end (`node_loss`),
the hang watchdog in Python (`watchdog`), and the processes of the node read from /proc (`procs`). "What happens when a node dies or hangs" starts
here; the hang killer outside Python that watches the heartbeat is runtime/hangwatch.py, an entry point.

May use: runtime.rank."""
