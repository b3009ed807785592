"""Login-node side: run directories, rendering, the Slurm client, backends, chain, status, triggers."""
