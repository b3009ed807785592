"""`submit RECIPE --from-hf MODEL_DIR --data SFT_DIR` at submit (finetune/): config.json -> the recipe's model
shape for each Llama-family layout, a `--set` that wins or contradicts, prepared SFT data told from chat
files, and the one-line refusals naming the flag (nothing written)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.errors import ConfigError
from megalaunch.finetune.data_dir import data_layer
from megalaunch.finetune.layers import submit_layers
from megalaunch.finetune.model_dir import model_values

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "vocab_size": 512, "hidden_act": "silu"}
LLAMA32_1B = {**TINY, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
              "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
             "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
             "tie_word_embeddings": True, "vocab_size": 151936, "use_sliding_window": False, "hidden_act": "silu"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "vocab_size": 32768, "sliding_window": None, "hidden_act": "silu"}


def model_dir(root: Path, cfg: dict[str, Any], *, tokenizer: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    if tokenizer:
        (root / "tokenizer_config.json").write_text("{}")
    return root


@pytest.mark.parametrize(("cfg", "expected"), [
    (LLAMA32_1B, {"num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 32,
                  "num_query_groups": 8, "rotary_base": 500000, "use_rope_scaling": True, "rope_scaling_factor": 32.0,
                  "untie_embeddings_and_output_weights": False, "add_qkv_bias": False, "norm_epsilon": 1e-5,
                  "max_position_embeddings": 131072}),
    (QWEN2_05B, {"num_layers": 24, "hidden_size": 896, "ffn_hidden_size": 4864, "num_attention_heads": 14,
                 "num_query_groups": 2, "rotary_base": 1000000, "use_rope_scaling": False, "add_qkv_bias": True,
                 "untie_embeddings_and_output_weights": False, "norm_epsilon": 1e-6, "max_position_embeddings": 32768}),
    (MISTRAL_7B, {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_query_groups": 8,
                  "rotary_base": 1000000, "untie_embeddings_and_output_weights": True, "add_qkv_bias": False}),
    (TINY, {"num_layers": 2, "hidden_size": 64, "num_query_groups": 2, "max_position_embeddings": 64, "seq_length": 64}),
])
def test_config_json_gives_the_model_shape(cfg: dict[str, Any], expected: dict[str, Any]) -> None:
    values = model_values("M", cfg, 4096)
    assert {k: values[k] for k in expected} == expected
    assert "seq_length" not in values or values["seq_length"] == cfg["max_position_embeddings"] < 4096


def _load(tmp_path: Path, *sets: str, cfg: dict[str, Any] = QWEN2_05B, data: str | None = None):
    hf = model_dir(tmp_path / "hf", cfg)
    layers = submit_layers("sft-llama3-1b", list(sets), from_hf=str(hf), data=data)
    return hf, load_recipe("sft-llama3-1b", list(sets), layers=layers)


def test_one_recipe_takes_the_shape_tokenizer_and_weights_from_the_model_dir(tmp_path: Path) -> None:
    hf, loaded = _load(tmp_path)
    m, d = loaded.recipe.model, loaded.recipe.data
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.add_qkv_bias, m.rotary_base) == (24, 896, 2, True, 1000000)
    assert m.use_rope_scaling is False and m.untie_embeddings_and_output_weights is False  # the recipe's Llama 3.2 values gone
    assert m.seq_length == 4096  # the recipe's, within the model's 32768 positions
    assert (d.tokenizer_type, d.tokenizer_model, loaded.recipe.checkpoint.from_hf) == ("HuggingFaceTokenizer", str(hf), str(hf))
    assert loaded.recipe.chain.export_hf is True  # the SFT recipes end with a Hugging Face model
    assert loaded.origin("model.num_layers") == f"--from-hf {hf}"


def test_a_pinned_value_wins_and_a_contradicting_shape_is_one_line(tmp_path: Path) -> None:
    _, loaded = _load(tmp_path, "model.seq_length=1024", "model.num_layers=24", "model.norm_epsilon=1e-6")
    assert loaded.recipe.model.seq_length == 1024 and loaded.origin("model.seq_length") == "--set"
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "model.num_layers=16")
    message = str(e.value)
    assert message.startswith("model.num_layers: --set model.num_layers=16 contradicts") and "\n" not in message
    assert "num_hidden_layers: model.num_layers 24" in message and "drop --set model.num_layers" in message


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p, "--from-hf: {p} is not a directory"),
    (lambda p: (p.mkdir(), p)[1], "--from-hf: {p} has no config.json"),
    (lambda p: model_dir(p, {**TINY, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
     "--from-hf: {p}/config.json: architecture ['GPT2LMHeadModel'] has no Megatron mapping"),
    (lambda p: model_dir(p, {k: v for k, v in TINY.items() if k != "num_hidden_layers"}), "lacks or garbles 'num_hidden_layers'"),
    (lambda p: model_dir(p, TINY, tokenizer=False), "--from-hf: {p} has no tokenizer files"),
])
def test_bad_model_dirs_are_one_line_naming_the_flag(tmp_path: Path, make: Any, expected: str) -> None:
    p = make(tmp_path / "m")
    with pytest.raises(ConfigError) as e:
        submit_layers("sft-llama3-1b", [], from_hf=str(p), data=None)
    assert expected.format(p=p) in str(e.value) and "\n" not in str(e.value) and "fix:" in str(e.value)


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_data_dir_is_told_apart(tmp_path: Path) -> None:
    for suffix in (".bin", ".idx", ".mask"):
        _touch(tmp_path / "prepared" / f"train{suffix}")
    _touch(tmp_path / "prepared" / "train.done.json", "{}")
    assert data_layer(str(tmp_path / "prepared"))["data"] == {
        "mock": False, "format": "chat", "blend": [{"path": str(tmp_path / "prepared")}], "blend_file": None}
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    _touch(tmp_path / "chats" / "a" / "one.jsonl", "\n" + json.dumps(row) + "\n")
    _touch(tmp_path / "chats" / "two.jsonl", json.dumps({"prompt": "p", "response": "r"}) + "\n")
    data = data_layer(str(tmp_path / "chats"))["data"]
    assert data["chat_files"] == str(tmp_path / "chats") and data["blend"] == [] and data["format"] == "chat"
    assert data_layer(str(tmp_path / "chats" / "two.jsonl"))["data"]["chat_files"] == str(tmp_path / "chats" / "two.jsonl")


@pytest.mark.parametrize(("files", "expected"), [
    ({}, "--data: {d} holds no chat files (.jsonl, .json, .parquet) and no prepared SFT data"),
    ({"notes.txt": "x"}, "--data: {d} holds no chat files"),
    ({"c.jsonl": '{"text": "a document, not a chat"}\n'}, "--data: {d}/c.jsonl row 1: neither 'messages' nor 'prompt'/'response'"),
    ({"c.jsonl": '\n{"messages": []}\n'}, "--data: {d}/c.jsonl row 2: 'messages' is empty"),
    ({"c.jsonl": "\n\n"}, "--data: {d}/c.jsonl holds no rows"),
    ({"t.bin": "", "t.idx": ""}, "--data: {d}/t has no loss mask (.mask): token data for pre-training"),
])
def test_bad_data_dirs_are_one_line_naming_the_flag(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for name, text in files.items():
        _touch(d / name, text)
    with pytest.raises(ConfigError) as e:
        data_layer(str(d))
    assert str(e.value).startswith(expected.format(d=d)) and "\n" not in str(e.value) and "fix:" in str(e.value)
    with pytest.raises(ConfigError, match="--data: /nowhere does not exist"):
        data_layer("/nowhere")


def test_chat_files_go_to_the_first_stage_not_the_blend(tmp_path: Path) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    _touch(tmp_path / "chats" / "c.jsonl", json.dumps(row) + "\n")
    _, loaded = _load(tmp_path, data=str(tmp_path / "chats"))
    d = loaded.recipe.data
    assert (d.mock, d.chat_files, list(d.blend), d.format) == (False, str(tmp_path / "chats"), [], "chat")
    assert loaded.origin("data.chat_files") == f"--data {tmp_path / 'chats'}"
    with pytest.raises(ConfigError, match=r"data\.chat_files needs data\.format: chat and the HuggingFaceTokenizer"):
        load_recipe("sft-llama3-1b", layers=[("--data", data_layer(str(tmp_path / "chats")))])  # no model, no tokenizer
