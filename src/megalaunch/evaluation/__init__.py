"""Evaluation at milestones (docs/eval.md): a complete checkpoint converted to Hugging Face and
evaluated by a job of its own (held-out perplexity, local tasks, lm-eval-harness tasks); results in
RUN/evals/<iteration>/results.json, the chain's W&B run and `status --evals`."""
