"""Login-node side: preparing and rendering runs, the Slurm client, backends, the chain, status."""
