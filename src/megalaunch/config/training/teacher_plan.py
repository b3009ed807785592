"""Where distillation's teacher runs (post_training.teacher_mode; docs/post_training.md, "The teacher online"),
decided at submit and printed (`submit`, `--dry-run`), read by the job from RUN/runtime.json's post_training
(`teacher_mode_resolved`, `teacher_why`).

- stage: the chain's first stage scores the data once and stores the top-k (runtime/scoring/teacher.py).
- online: the teacher in every rank's process (runtime/flows/distill.py).
- auto: online where the planner's memory model says the student's training, the teacher's bf16 weights and
  one micro-batch of its logits fit the GPU; else stage (always on CPUs, with no GPU memory stated, and for a
  megatron teacher, which only the stage converts)."""

from __future__ import annotations

import json
from pathlib import Path

from megalaunch.config.schema import Recipe

GIB = 1024**3
HEADROOM = 0.9  # of the GPU's memory: what online may plan to use


def _teacher_bytes(teacher: Path) -> tuple[float, int] | None:
    """(bf16 weight bytes, vocabulary rows) of a Hugging Face teacher, from its files and config.json."""
    try:
        config = json.loads((teacher / "config.json").read_text())
    except (OSError, ValueError):
        return None
    files = sum(p.stat().st_size for p in teacher.glob("*.safetensors")) or \
        sum(p.stat().st_size for p in teacher.glob("*.bin"))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    bf16 = files / 2 if dtype == "float32" else files
    vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    return float(bf16), vocab


def teacher_choice(recipe: Recipe, topo_dp: int = 1, num_microbatches: int = 1,
                   vocab_size: int | None = None) -> tuple[str, str] | None:
    """(stage | online, why) for a distillation run; None for any other."""
    pt = recipe.post_training
    if pt.method != "distill":
        return None
    if pt.teacher_mode != "auto":
        return pt.teacher_mode, f"post_training.teacher_mode {pt.teacher_mode}"
    from megalaunch.config.planner.fit import gpu_memory, model_shape, recipe_layout
    from megalaunch.config.planner.memory import estimate

    teacher = _teacher_bytes(Path(str(pt.teacher)).expanduser())
    if teacher is None:
        return "stage", "auto: the teacher is no Hugging Face directory (the stage converts a megatron teacher)"
    mem = gpu_memory(recipe)
    if mem is None:
        return "stage", "auto: no GPU memory stated (CPUs, or no cluster.gpu / gpu_memory_gb)"
    weights, vocab = teacher
    m, t, tp = recipe.model, recipe.training, recipe.parallel.tensor_model_parallel_size
    tokens = t.micro_batch_size * m.seq_length
    logits = tokens * vocab * (2 + 4 + 4)  # bf16 logits, their float32 log-softmax and a temporary
    student_kl = tokens * (vocab_size or vocab) / tp * 4 * 3  # the student's float32 log-softmax copies
    student = estimate(model_shape(recipe, vocab_size), recipe_layout(recipe, topo_dp, num_microbatches)).needed_gib()
    need = student + (weights + logits + student_kl) / GIB
    fits = need <= HEADROOM * mem.gib
    return ("online" if fits else "stage",
            f"auto: student ~{student:.0f} GiB + teacher bf16 {weights / GIB:.1f} GiB + logits "
            f"{(logits + student_kl) / GIB:.1f} GiB = ~{need:.0f} GiB of {mem.gib:.0f} GiB "
            f"({'fits' if fits else 'does not fit'} in {HEADROOM:.0%})")


def job_teacher(recipe: Recipe) -> dict[str, str]:
    """The choice as the job reads it (RUN/runtime.json's post_training)."""
    from megalaunch.config.topology import topology

    if recipe.post_training.method != "distill":
        return {}
    topo = topology(recipe)
    choice = teacher_choice(recipe, topo.dp, topo.num_microbatches, recipe.data.vocab_size)
    return {"teacher_mode_resolved": choice[0], "teacher_why": choice[1]} if choice else {}


def resolved_teacher_mode(recipe: Recipe) -> str | None:
    """stage | online for a distillation run (as `job_teacher` decides), None for any other."""
    return job_teacher(recipe).get("teacher_mode_resolved")


def check_distill_submit(recipe: Recipe) -> None:
    """What a submit of a distillation run refuses that a plan or a render does not (the shipped recipes name
    the teacher with a placeholder and train on mock data): a teacher that is not there, an online teacher
    that is no Hugging Face directory, mock data."""
    import os

    from megalaunch.errors import PreflightError

    pt = recipe.post_training
    if pt.method != "distill":
        return
    teacher = Path(os.path.expanduser(str(pt.teacher)))
    if not teacher.exists():
        raise PreflightError(f"{pt.teacher} does not exist", field="post_training.teacher",
                             valid="a Hugging Face model directory or a megatron checkpoint with the student's tokenizer",
                             fix="--set post_training.teacher=DIR")
    if teacher_choice(recipe) == ("online", "post_training.teacher_mode online") and \
            not (teacher / "config.json").is_file():
        raise PreflightError(f"{pt.teacher} has no config.json: the online teacher runs with transformers",
                             field="post_training.teacher", valid="a Hugging Face model directory",
                             fix="--set post_training.teacher_mode=stage (the stage converts a megatron teacher)")
    if recipe.data.mock and not recipe.data.chat_files:
        raise PreflightError("distillation trains on chat data, not on mock data", field="data",
                             valid="chat files, or `megalaunch data sft` output in data.blend",
                             fix=f"submit {recipe.name} --from-hf STUDENT_DIR --data CHATS_DIR")
