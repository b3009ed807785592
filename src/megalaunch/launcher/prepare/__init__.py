"""From a recipe to a run directory: preflight, rendering and the files the job reads (`prepare`,
`render`), the job script's #SBATCH header (`sbatch`), where each value came from (`explain`), the stop
signal's lead (`signal_lead`), and the checks before a chain resumes (`resume_check`).

May use: config, data, runtime, rundir; no other part of the launcher."""
