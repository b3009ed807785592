"""Which failures end a chain at once (config_error) and what the user is told: real exceptions
raised and caught, judged by runtime/rank/failures.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.runtime.rank.failures import (
    ConfigFailure,
    check_kernels,
    classify,
    describe,
    exit_failure,
    installed,
)


def _raised(fn):  # the exception with its traceback, as the trainer catches it
    try:
        fn()
    except BaseException as e:
        return e
    raise AssertionError("did not raise")


@pytest.fixture()
def validate_args(tmp_path, monkeypatch):
    """A module outside the tests (pytest rewrites asserts in test modules), with a bare assert
    like Megatron's argument validation."""
    (tmp_path / "fake_arguments.py").write_text("def validate(threads):\n    assert threads > 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("fake_arguments").validate


def test_a_bare_assert_before_the_first_iteration_is_a_config_error_with_its_source_line(validate_args) -> None:
    f = classify(_raised(lambda: validate_args(0)), started=False)
    assert f.config
    assert f.reason.startswith("AssertionError: assert threads > 0 (")
    assert f.reason.endswith("fake_arguments.py:2)")


def test_the_same_error_after_training_started_counts_against_the_budget(validate_args) -> None:
    assert not classify(_raised(lambda: validate_args(0)), started=True).config


def test_an_assert_with_text_keeps_the_text_and_gets_the_known_fix() -> None:
    def build() -> None:
        raise AssertionError("sequence parallel not supported by torch LayerNorm")

    f = classify(_raised(build), started=False)
    assert f.config and "sequence parallel not supported by torch LayerNorm" in f.reason
    assert f.fix == "--set parallel.sequence_parallel=false"


@pytest.mark.parametrize("error", [
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ConnectionResetError("Connection reset by peer"),
    TimeoutError("the store timed out"),
    ValueError("gloo: connection closed by peer"),  # a deterministic class with transient words
])
def test_transient_failures_before_the_first_iteration_are_not_config_errors(error: BaseException) -> None:
    def boom() -> None:
        raise error

    assert not classify(_raised(boom), started=False).config


def test_an_out_of_memory_class_is_transient_whatever_its_text() -> None:
    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name, without importing torch
        pass

    def boom() -> None:
        raise OutOfMemoryError("allocation failed")

    assert not classify(_raised(boom), started=False).config


def test_a_missing_file_the_recipe_names_is_a_config_error() -> None:
    def boom() -> None:
        Path("/nonexistent/tokenizer.json").read_text()

    f = classify(_raised(boom), started=False)
    assert f.config and "FileNotFoundError" in f.reason and "/nonexistent/tokenizer.json" in f.reason


def test_config_failure_keeps_its_reason_and_fix() -> None:
    f = classify(ConfigFailure("checkpoint 40 is incomplete", "resume from 20"), started=True)
    assert f.config and f.reason == "checkpoint 40 is incomplete" and f.fix == "resume from 20"


def test_describe_is_one_line() -> None:
    def boom() -> None:
        raise ValueError("first line\nsecond line\n\tthird")

    text = describe(_raised(boom))
    assert "\n" not in text and text.startswith("ValueError: first line second line third (")


def test_sys_exit_before_training_is_a_config_error_after_is_not() -> None:
    assert exit_failure(2, started=False).config
    assert not exit_failure(2, started=True).config


@pytest.mark.skipif(installed("transformer_engine"), reason="transformer-engine is installed here")
def test_attention_te_without_transformer_engine_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigFailure) as e:
        check_kernels(["--num-layers", "2"], "te")
    assert "training.attention: te needs transformer-engine" in e.value.reason
    assert "training.attention=sdpa" in (e.value.fix or "")
    with pytest.raises(ConfigFailure, match="transformer_impl: transformer_engine"):
        check_kernels(["--transformer-impl", "transformer_engine"], "sdpa")


@pytest.mark.skipif(installed("flash_attn"), reason="flash-attn is installed here")
def test_flash_attn_flag_without_flash_attn_is_refused() -> None:
    with pytest.raises(ConfigFailure, match="use_flash_attn needs flash-attn"):
        check_kernels(["--use-flash-attn"], "local")


def test_kernels_that_are_there_pass() -> None:
    assert check_kernels(["--transformer-impl", "local"], "sdpa") == []


def test_a_megatron_argument_in_the_reason_is_traced_to_the_recipe_field_that_set_it() -> None:
    from megalaunch.runtime.rank.failures import recipe_field_fix

    recipe = {"training": {"lr": 0.1, "min_lr": 0.5}, "megatron_args": {"num_dataset_builder_threads": 0}}
    fix = recipe_field_fix("AssertionError: assert args.min_lr <= args.lr (megatron/training/arguments.py:1320)", recipe)
    assert fix == ("check training.min_lr (now 0.5), training.lr (now 0.1) in the recipe: Megatron refused it; "
                   "correct it and submit again")
    assert recipe_field_fix("AssertionError: assert args.foo", recipe) is None


def test_a_package_version_clash_in_the_job_environment_is_not_blamed_on_the_checkpoint() -> None:
    """Seen on the device: nvidia-resiliency-ext 0.4 installed next to megatron-core 0.19.2 broke Megatron's
    import inside megatron/core/dist_checkpointing: the fix is the package, not the checkpoint."""
    from megalaunch.runtime.rank.failures import known_fix

    nvrx = ("AttributeError: module 'nvidia_resiliency_ext' has no attribute '__version__' | "
            "megatron/core/dist_checkpointing/strategies/nvrx.py:85")
    assert "nvidia-resiliency-ext >= 0.6" in (known_fix(nvrx) or "")
    other = "ImportError: cannot import name 'foo' from 'bar' | megatron/core/dist_checkpointing/x.py:3"
    fix = known_fix(other) or ""
    assert "version megatron-core expects" in fix and "checkpoint" not in fix
    assert "checkpoint does not match" in (known_fix("RuntimeError: size mismatch for x | megatron/a.py:1") or "")
