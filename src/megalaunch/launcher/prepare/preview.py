"""What a submit says about a prepared run before (or instead of) writing it: the one-line summary,
the checkpoints' disk budget with the verdict, and the dry run's text (the run directory, the job script,
Megatron's arguments)."""

from __future__ import annotations

from megalaunch.errors import PreflightError
from megalaunch.launcher.prepare.outlook import outlook_lines
from megalaunch.launcher.prepare.prepare import PreparedRun


def disk_lines(prepared: PreparedRun) -> list[str]:
    """The checkpoint size, the peak on disk and the room for it; a dry run adds what submit would say."""
    budget = prepared.budget
    if budget is None:
        return []
    lines = budget.lines()
    if not budget.fits and prepared.recipe.checkpoint.disk_check:
        from megalaunch.config.preflight import tokenizer_vocab_size
        from megalaunch.config.storage import check_disk

        try:
            check_disk(prepared.recipe, budget, tokenizer_vocab_size(prepared.recipe, prepared.tokenizer))
        except PreflightError as e:
            lines.append(f"disk: submit refuses this: {e}")
    return lines


def summary(prepared: PreparedRun) -> str:
    r, topo = prepared.recipe, prepared.topology
    return (f"{r.name}: {r.model.num_layers} layers x {r.model.hidden_size} hidden, world {topo.world_size} "
            f"= TP {topo.tp} x PP {topo.pp} x CP {topo.cp} x DP {topo.dp}, "
            f"{r.training.global_batch_size} seqs x {r.model.seq_length} tokens per step, "
            f"{r.training.train_iters} iterations, backend {r.cluster.backend}")


def stage_lines(prepared: PreparedRun) -> list[str]:
    """The chain's first and last stages, where they write (launcher/chain/first_stage.py, last_stage.py)."""
    r, root = prepared.recipe, prepared.paths.root
    lines = []
    if r.data.chat_files:
        lines.append(f"first stage: tokenize {r.data.chat_files} with the model's chat template -> {root}/sft_data")
    if r.checkpoint.from_hf:
        lines.append(f"first stage: convert {r.checkpoint.from_hf} -> {root}/pretrained, then train from it")
    if r.post_training.method == "distill":  # where the teacher runs (config/training/teacher_plan.py), and why
        from megalaunch.config.training.teacher_plan import teacher_choice

        mode, why = teacher_choice(r, prepared.topology.dp, prepared.topology.num_microbatches, r.data.vocab_size) \
            or ("stage", "")
        lines.append(f"teacher: {mode} ({why})" + (f": the first stage scores the chat data with "
                     f"{r.post_training.teacher} (top {r.post_training.teacher_top_k}) -> {root}/scores/teacher"
                     if mode == "stage" else f": {r.post_training.teacher} runs in every rank's process"))
    if r.post_training.needs_reference:  # DPO's reference (config/training/reference_plan.py): the choice, and why
        from megalaunch.config.training.reference_plan import reference_choice

        choice = reference_choice(r, prepared.topology.dp, prepared.topology.num_microbatches, r.data.vocab_size)
        if choice is not None:
            lines.append(f"reference: {choice[0]} ({choice[1]})" + (
                f" -> {root}/scores/reference, scored in the first segment before iteration 1" if choice[0] == "stage"
                else ": a frozen copy of the starting checkpoint in the job, loaded in every segment"))
    if r.chain.export_hf:
        lines.append(f"last stage: the final checkpoint as a Hugging Face model -> {root}/hf")
    return lines


def dry_run_text(prepared: PreparedRun) -> str:
    """What a submit would create: the run directory, the job script, Megatron's arguments."""
    import shlex

    lines = [f"dry run: {summary(prepared)}", f"would create {prepared.paths.root}", *stage_lines(prepared),
             *outlook_lines(prepared.outlook, why=True), *disk_lines(prepared)]
    if prepared.tokenizer is not None:
        lines.append(f"{prepared.tokenizer.describe()} -> {prepared.paths.tokenizer}/")
    if "job.sbatch" in prepared.files:
        lines += ["----- job.sbatch -----", prepared.files["job.sbatch"].rstrip("\n")]
    lines += ["----- megatron.args -----",
              shlex.join(line for line in prepared.files["megatron.args"].splitlines() if line),
              "nothing written, nothing submitted"]
    return "\n".join(lines)
