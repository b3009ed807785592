"""Declarative two-way name tables: Megatron-core sharded keys <-> Hugging Face tensor names.

One `Rule` per Megatron tensor. Layer tensors use Megatron's stacked key (the layer index is the
first dimension of the global tensor, as `GPTModel.sharded_state_dict()` writes it) and `{i}` in
the Hugging Face names. Shapes are symbolic (see `Dims.symbols`); `when` names a condition on
`Dims` ("qkv_bias", "untied", "qk_norm"). Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 share the Hugging Face
names; the conditions cover their differences (Qwen2's QKV bias, Qwen3's per-head query and key norms, tied
embeddings of small models)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megalaunch.conversion.dims import Dims


@dataclass(frozen=True)
class Rule:
    mcore: str
    """Megatron sharded-state-dict key (layer tensors: `decoder.layers.<name>`, stacked over layers)."""
    hf: tuple[str, ...]
    """Hugging Face tensor names, `{i}` standing for the layer index."""
    hf_shapes: tuple[tuple[str, ...], ...]
    """Symbolic shape of each Hugging Face tensor."""
    mcore_shape: tuple[str, ...]
    """Symbolic shape of the Megatron tensor (one layer's slice for layer tensors)."""
    transform: str = "copy"
    when: str | None = None
    vocab_rows: bool = False
    """Megatron marks these with allow_shape_mismatch (vocabulary padding may differ)."""

    @property
    def per_layer(self) -> bool:
        return self.mcore.startswith("decoder.layers.")

    def applies(self, dims: Dims) -> bool:
        return {None: True, "qkv_bias": dims.qkv_bias, "untied": not dims.tied, "qk_norm": dims.qk_norm}[self.when]

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        return tuple(n.format(i=layer) for n in self.hf)


_ATTN = "model.layers.{i}.self_attn"
_MLP = "model.layers.{i}.mlp"

LLAMA: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (("v", "h"),), ("vp", "h"),
         "vocab", vocab_rows=True),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ("model.layers.{i}.input_layernorm.weight",),
         (("h",),), ("h",)),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"),
         (("q", "h"), ("kv", "h"), ("kv", "h")), ("qkv", "h"), "qkv"),
    Rule("decoder.layers.self_attention.linear_qkv.bias",
         (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"),
         (("q",), ("kv",), ("kv",)), ("qkv",), "qkv", when="qkv_bias"),
    Rule("decoder.layers.self_attention.q_layernorm.weight", (f"{_ATTN}.q_norm.weight",), (("d",),), ("d",),
         when="qk_norm"),
    Rule("decoder.layers.self_attention.k_layernorm.weight", (f"{_ATTN}.k_norm.weight",), (("d",),), ("d",),
         when="qk_norm"),
    Rule("decoder.layers.self_attention.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), (("h", "q"),), ("h", "q")),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", ("model.layers.{i}.post_attention_layernorm.weight",),
         (("h",),), ("h",)),
    Rule("decoder.layers.mlp.linear_fc1.weight", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
         (("f", "h"), ("f", "h")), ("2f", "h"), "gated_mlp"),
    Rule("decoder.layers.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), (("h", "f"),), ("h", "f")),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), (("h",),), ("h",)),
    Rule("output_layer.weight", ("lm_head.weight",), (("v", "h"),), ("vp", "h"), "vocab", when="untied",
         vocab_rows=True),
)

# Per-layer modules whose `_extra_state` Megatron saves as a ShardedObject (None for the local spec,
# FP8 metadata for transformer-engine) and insists on finding when it loads. Written as None; the
# superset of the local and transformer-engine specs, so either loads the checkpoint.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")

TABLES: dict[str, tuple[Rule, ...]] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA}

# Hugging Face tensors that carry no weights (buffers some old exports include).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Item:
    """One unit of conversion: a Megatron tensor (one layer's slice) and its Hugging Face sources."""

    rule: Rule
    layer: int | None

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.rule.hf_names(self.layer)

    @property
    def label(self) -> str:
        return self.rule.mcore if self.layer is None else f"{self.rule.mcore}[{self.layer}]"


def items(table: tuple[Rule, ...], dims: Dims) -> Iterator[Item]:
    """Every conversion unit, layer by layer (the order of a Hugging Face checkpoint)."""
    rules = [r for r in table if r.applies(dims)]
    yield from (Item(r, None) for r in rules if not r.per_layer and r.mcore.startswith("embedding."))
    for i in range(dims.num_layers):
        yield from (Item(r, i) for r in rules if r.per_layer)
    yield from (Item(r, None) for r in rules if not r.per_layer and not r.mcore.startswith("embedding."))
