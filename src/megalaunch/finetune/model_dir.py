"""`--from-hf MODEL_DIR` at submit: the model's shape, tokenizer and starting weights from its directory.

config.json is read with plain `json` and mapped by conversion/families.py (the mapping the converter
itself uses, so the shape submitted is the shape the first stage's conversion checks against). The shape
fields replace the recipe's (one SFT recipe fits every Llama-family checkpoint, dense or mixture of experts);
a `--set` of a shape field that disagrees with config.json is an error, any other `--set` wins. The router's
aux-loss weight (`router_aux_loss_coef`) is taken too, but as a training choice: a `--set` of it wins."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megalaunch.config.loader import parse_set
from megalaunch.conversion.errors import UnsupportedModelError
from megalaunch.conversion.families import ARCH_FIELDS, model_from_hf_config
from megalaunch.conversion.families_moe import MOE_HF_KEYS
from megalaunch.errors import ConfigError

SHAPE_FIELDS = (*ARCH_FIELDS, "max_position_embeddings")
# Taken from config.json as well, without being pinned: training choices a --set may change.
TRAINING_FIELDS = ("moe_aux_loss_coeff",)
# The config.json key each shape field comes from (named in a conflict's error).
HF_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
           "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
           "rotary_base": "rope_theta", "use_rope_scaling": "rope_scaling", "rope_scaling_factor": "rope_scaling",
           "norm_epsilon": "rms_norm_eps", "untie_embeddings_and_output_weights": "tie_word_embeddings",
           "add_qkv_bias": "architectures", "max_position_embeddings": "max_position_embeddings",
           "kv_channels": "head_dim", "qk_layernorm": "architectures", **MOE_HF_KEYS}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_FIX = "pass a Hugging Face model directory (config.json, *.safetensors, tokenizer files) to --from-hf"


def read_config(model_dir: str) -> dict[str, Any]:
    """config.json of `model_dir` as a dict; one-line errors naming --from-hf for what is missing."""
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{model_dir} is not a directory", field="--from-hf", fix=_FIX)
    path = root / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{model_dir} has no config.json", field="--from-hf", fix=_FIX) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e})", field="--from-hf", fix=_FIX) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object", field="--from-hf", fix=_FIX)
    return cfg


def model_values(model_dir: str, cfg: dict[str, Any], recipe_seq_length: int) -> dict[str, Any]:
    """The recipe's `model` section from config.json: every shape field, and the sequence length capped at
    the positions the model supports."""
    try:
        hf = model_from_hf_config(cfg)
    except UnsupportedModelError as e:
        raise ConfigError(f"{model_dir}/config.json: {e.message}", field="--from-hf", valid=e.valid,
                          fix="fine-tune a Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint "
                              "(docs/conversion.md)") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{model_dir}/config.json lacks or garbles {e}", field="--from-hf", fix=_FIX) from None
    values = {name: getattr(hf.model, name) for name in (*SHAPE_FIELDS, *TRAINING_FIELDS)}
    if recipe_seq_length > hf.model.max_position_embeddings:
        values["seq_length"] = hf.model.max_position_embeddings
    return values


def check_pins(sets: list[str], values: dict[str, Any], model_dir: str) -> None:
    """A `--set model.FIELD=V` of a shape field must agree with config.json: one line naming both."""
    for expr in sets:
        parts, pinned = parse_set(expr)
        if len(parts) != 2 or parts[0] != "model" or parts[1] not in SHAPE_FIELDS:
            continue
        field, found = parts[1], values[parts[1]]
        if not _same(pinned, found):
            raise ConfigError(f"--set model.{field}={pinned} contradicts {model_dir}/config.json "
                              f"({HF_KEYS.get(field, field)}: model.{field} {found})", field=f"model.{field}",
                              fix=f"drop --set model.{field} (--from-hf gives the shape), or pass the model it fits")


def _same(pinned: Any, found: Any) -> bool:
    if isinstance(found, bool) or found is None or isinstance(pinned, bool):
        return bool(pinned == found)
    try:
        return math.isclose(float(pinned), float(found), rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


def from_hf_layer(model_dir: str, sets: list[str], recipe_seq_length: int) -> dict[str, Any]:
    """What `--from-hf MODEL_DIR` sets under `--set`: the shape, the tokenizer and the weights to start from."""
    cfg = read_config(model_dir)
    root = Path(model_dir).expanduser().absolute()
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})", field="--from-hf",
                          fix="save the tokenizer next to the model (tokenizer.save_pretrained(MODEL_DIR))")
    values = model_values(model_dir, cfg, recipe_seq_length)
    check_pins(sets, values, model_dir)
    return {"model": values, "checkpoint": {"from_hf": str(root)},
            "data": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(root)}}
