"""Where distillation's teacher runs (config/training/teacher_plan.py): auto puts it online when the planner says
the student, the teacher's bf16 weights and a micro-batch of logits fit the GPU, else in the stage; CPUs and a
megatron teacher always take the stage; the choice reaches the job (RUN/runtime.json's post_training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.training.teacher_plan import job_teacher, teacher_choice
from megalaunch.launcher.prepare.job_inputs import runtime_settings

GB = 1000**3


def _teacher(root: Path, weight_bytes: int, dtype: str = "bfloat16") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"vocab_size": 128256, "torch_dtype": dtype}))
    with open(root / "model.safetensors", "wb") as f:  # sparse: the size is what counts
        f.truncate(weight_bytes)
    return root


def _recipe(teacher: Path, mode: str = "auto", ref: str = "distill-llama3-1b", *more: str):
    sets = [f"post_training.teacher={teacher}", f"post_training.teacher_mode={mode}", *more]
    if ref == "distill-llama3-1b":
        sets += ["cluster.gpu=H200", "cluster.gpus_per_node=8"]
    return load_recipe(ref, sets).recipe


@pytest.mark.parametrize(("weights", "dtype", "expected"), [
    (16 * GB, "bfloat16", "online"),  # an 8B teacher beside a 1B student on an H200
    (32 * GB, "float32", "online"),  # the same teacher stored in float32: loaded as bf16
    (140 * GB, "bfloat16", "stage"),  # a 70B teacher does not fit
])
def test_auto_is_online_where_the_teacher_fits(tmp_path: Path, weights: int, dtype: str, expected: str) -> None:
    mode, why = teacher_choice(_recipe(_teacher(tmp_path / "t", weights, dtype))) or ("", "")
    assert mode == expected, why
    assert why.startswith("auto: student ~") and ("fits" if expected == "online" else "does not fit") in why


def test_cpus_a_megatron_teacher_and_an_explicit_mode(tmp_path: Path) -> None:
    small = _teacher(tmp_path / "t", 16 * GB)
    assert teacher_choice(_recipe(small, ref="distill-tiny"))[0] == "stage"  # type: ignore[index]
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    mode, why = teacher_choice(_recipe(mcore)) or ("", "")
    assert mode == "stage" and "megatron teacher" in why
    for given in ("stage", "online"):
        assert teacher_choice(_recipe(small, given)) == (given, f"post_training.teacher_mode {given}")
    assert teacher_choice(load_recipe("sft-tiny").recipe) is None and job_teacher(load_recipe("sft-tiny").recipe) == {}


def test_the_choice_reaches_the_job(tmp_path: Path) -> None:
    settings = runtime_settings(_recipe(_teacher(tmp_path / "t", 16 * GB)))
    assert settings.post_training is not None
    assert settings.post_training["teacher_mode"] == "auto"
    assert settings.post_training["teacher_mode_resolved"] == "online"
    assert "fits" in settings.post_training["teacher_why"]


def test_submit_refuses_the_placeholder_teacher_and_mock_data_in_one_line(tmp_path: Path) -> None:
    """A plan or a render of a shipped distill recipe works as shipped; a submit needs the user's teacher and data."""
    from megalaunch.errors import PreflightError
    from megalaunch.launcher.prepare.prepare import prepare_submission

    for ref in ("distill-tiny", "distill-llama3-1b"):
        with pytest.raises(PreflightError) as e:
            prepare_submission(ref, [f"run.root={tmp_path}"], check_disk=False)
        assert "post_training.teacher" in str(e.value) and "does not exist" in str(e.value)
        assert "--set post_training.teacher=DIR" in str(e.value) and "\n" not in str(e.value)
    teacher = _teacher(tmp_path / "t", 1000)
    with pytest.raises(PreflightError) as e:
        prepare_submission("distill-tiny", [f"run.root={tmp_path}", f"post_training.teacher={teacher}"],
                           check_disk=False)
    assert "not on mock data" in str(e.value) and "--data CHATS_DIR" in str(e.value)
    (tmp_path / "mcore").mkdir()
    with pytest.raises(PreflightError) as e:
        prepare_submission("distill-tiny", [f"run.root={tmp_path}", f"post_training.teacher={tmp_path / 'mcore'}",
                                            "post_training.teacher_mode=online"], check_disk=False)
    assert "has no config.json" in str(e.value) and "teacher_mode=stage" in str(e.value)


def test_the_disk_budget_counts_the_store_only_where_the_stage_runs(tmp_path: Path) -> None:
    from megalaunch.config.training.score_budget import score_bytes_per_token

    small = _teacher(tmp_path / "t", 16 * GB)
    assert score_bytes_per_token(_recipe(small, "stage")) == 8.0 * 32  # int32 id + float32 log-prob per kept entry
    assert score_bytes_per_token(_recipe(small, "online")) == 0.0
    assert score_bytes_per_token(_recipe(small, "auto")) == 0.0  # it fits: online, nothing stored
    assert score_bytes_per_token(_recipe(_teacher(tmp_path / "big", 140 * GB), "auto")) == 8.0 * 32


def test_the_teacher_stage_refuses_two_datasets_of_one_name(tmp_path: Path) -> None:
    """The store names a dataset's rows by its prefix's basename: two `train` prefixes would share files."""
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.scoring.teacher import TeacherJob, TeacherRefused

    paths = RunPaths(tmp_path)
    paths.data_blend.write_text(f"1 {tmp_path}/a/train 1 {tmp_path}/b/train 1 {tmp_path}/b/valid\n")
    with pytest.raises(TeacherRefused, match=r"same name \(train\)"):
        TeacherJob.of_settings(paths, {"method": "distill", "teacher": str(tmp_path)})
    paths.data_blend.write_text(f"1 {tmp_path}/a/train 1 {tmp_path}/b/valid\n")
    job = TeacherJob.of_settings(paths, {"method": "distill", "teacher": str(tmp_path), "teacher_top_k": 8})
    assert job.prefixes == [f"{tmp_path}/a/train", f"{tmp_path}/b/valid"] and job.top_k == 8


def test_grpo_rounds_are_counted_by_the_samples_trained() -> None:
    """GRPO's rounds arrive while the chain trains: RUN/rollouts (tokens, mask, old log-probabilities) and the
    per-round reference and old scores are bounded by train_iters x global batch x (seq_length + 1) tokens."""
    from megalaunch.config.training.score_budget import ROLLOUT_BYTES_PER_TOKEN, scores_bytes

    sets = ["post_training.method=grpo", "post_training.rollouts=/tmp/rounds", "training.train_iters=10",
            "training.global_batch_size=8"]
    plain = load_recipe("grpo-tiny", [*sets, "post_training.old_logprobs=current"]).recipe
    with_kl = load_recipe("grpo-tiny", [*sets, "post_training.old_logprobs=current", "post_training.kl_coeff=0.1"])
    staged = load_recipe("grpo-tiny", [*sets, "post_training.kl_coeff=0.1"]).recipe  # old_logprobs stage (default)
    tokens = 10 * 8 * (plain.model.seq_length + 1)
    assert scores_bytes(plain, None) == ROLLOUT_BYTES_PER_TOKEN * tokens
    assert scores_bytes(with_kl.recipe, None) == (ROLLOUT_BYTES_PER_TOKEN + 4) * tokens
    assert scores_bytes(staged, None) == (ROLLOUT_BYTES_PER_TOKEN + 8) * tokens  # RUN/scores/old: 4 bytes a token
