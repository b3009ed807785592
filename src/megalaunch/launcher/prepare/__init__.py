"""From a recipe to a run directory: preflight and everything rendered in memory (`prepare`), what the
job is given (`job_inputs`: each task's command, runtime.json's settings, the job script's context),
writing the run directory into place (`write`), what submit says before writing (`preview`), the Jinja2
rendering (`render`), the job script's #SBATCH header (`sbatch`), where each value came from (`explain`),
the stop signal's lead (`signal_lead`), and the checks before a chain resumes (`resume_check`).

May use: config, data, runtime, rundir; no other part of the launcher."""
