"""Tokenization as a stage of its own: plan dumps from input files, run one datatrove job per dump
(a Slurm job array or the local backend), resume from completion markers, report progress."""
