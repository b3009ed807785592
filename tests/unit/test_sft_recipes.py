"""The SFT recipes' settings: what reaches Megatron (the chat data needs no new flag, the per-token loss
and the converted model do), and the one-line refusals of preflight and the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.megatron_args import megatron_args
from megalaunch.config.preflight import preflight
from megalaunch.errors import MegalaunchError
from megalaunch.rundir.paths import RunPaths


def _args(*sets: str, recipe: str = "sft-tiny") -> list[str]:
    return megatron_args(load_recipe(recipe, list(sets)).recipe, RunPaths(Path("/runs/r")))


def test_sft_recipes_train_on_the_mask_with_the_per_token_loss() -> None:
    for ref in ("sft-tiny", "sft-llama3-1b"):
        recipe = load_recipe(ref).recipe
        assert recipe.data.format == "chat" and recipe.megatron_args["calculate_per_token_loss"] is True
    args = _args()
    assert "--calculate-per-token-loss" in args
    for flag in ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--flow", "--format"):
        assert flag not in args


def test_from_hf_trains_from_the_runs_own_conversion(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    args = _args(f"checkpoint.from_hf={tmp_path / 'hf'}")
    assert args[args.index("--pretrained-checkpoint") + 1] == "/runs/r/pretrained"


@pytest.mark.parametrize(("sets", "expected"), [
    (["checkpoint.from_hf=/nowhere"], "checkpoint.from_hf: /nowhere has no config.json"),
    (["data.mock=false", "data.blend=[{path: DATA}]"], "has no loss mask"),
    (["checkpoint.load=/x", "checkpoint.from_hf=/y"], "checkpoint.load and checkpoint.from_hf both"),
    (["training.flow=not a flow"], "training.flow 'not a flow' must be 'module:Class'"),
])
def test_refusals_are_one_line(sets: list[str], expected: str, tmp_path: Path) -> None:
    from megalaunch.data.writer import IndexedWriter

    writer = IndexedWriter(tmp_path / "pretrain", "uint16")  # tokens without a .mask: pre-training data
    writer.add_batch([[1, 2, 3]])
    writer.close()
    sets = [s.replace("DATA", str(tmp_path / "pretrain")) for s in sets]
    with pytest.raises((MegalaunchError, ValueError)) as e:
        preflight(load_recipe("sft-tiny", sets).recipe)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_chat_data_must_come_from_the_runs_tokenizer_with_a_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.support.chat import chat_rows, make_chat_tokenizer, write_jsonl

    from megalaunch.tokenization.chat.build import build

    make_chat_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "in" / "c.jsonl", chat_rows(4))
    build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    data = ["data.mock=false", f"data.blend=[{{path: {tmp_path / 'out'}}}]", "data.tokenizer_type=HuggingFaceTokenizer"]
    preflight(load_recipe("sft-tiny", [*data, f"data.tokenizer_model={tmp_path / 'tok'}"]).recipe)  # fine

    make_chat_tokenizer(tmp_path / "other", vocab_size=448)
    with pytest.raises(MegalaunchError, match="was tokenized with another tokenizer") as e:
        preflight(load_recipe("sft-tiny", [*data, f"data.tokenizer_model={tmp_path / 'other'}"]).recipe)
    assert e.value.field == "data.tokenizer_model" and "\n" not in str(e.value)

    (tmp_path / "bare").mkdir()  # the same tokenizer.json without its chat template
    (tmp_path / "bare" / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    with pytest.raises(MegalaunchError, match="has no chat template"):
        preflight(load_recipe("sft-tiny", [*data, f"data.tokenizer_model={tmp_path / 'bare'}"]).recipe)
