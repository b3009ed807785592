"""Declarative two-way name tables: Megatron-core sharded keys <-> Hugging Face tensor names.

One `Rule` per Megatron tensor. Layer tensors use Megatron's stacked key (the layer index is the
first dimension of the global tensor, as `GPTModel.sharded_state_dict()` writes it) and `{i}` in
the Hugging Face names. Shapes are symbolic (see `Dims.symbols`); `when` names a condition on
`Dims` ("qkv_bias", "untied", "qk_norm", "dense", "shared", "shared_gate"). Llama 2/3/3.1, Mistral, Qwen2 and
Qwen3 share the Hugging Face names; the conditions cover their differences (Qwen2's QKV bias, Qwen3's per-head
query and key norms, tied embeddings of small models).

Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) share the attention rules and replace the dense MLP by a
router and the experts. An expert tensor (`per_expert`) has a second stacked axis, the expert index (`{e}` in
the Hugging Face names): Megatron-core 0.19's SequentialMLP saves `decoder.layers.mlp.experts.experts.linear_fc1.
weight` as one global [layers, experts, 2 x ffn, hidden] tensor (gate rows, then up rows, as the dense fc1),
whatever the EP and expert TP; megalaunch's grouped experts save the same keys."""

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
    per_expert: bool = False
    """One tensor per routed expert: the expert index is the global tensor's second axis, `{e}` in `hf`."""

    @property
    def per_layer(self) -> bool:
        return self.mcore.startswith("decoder.layers.")

    def applies(self, dims: Dims) -> bool:
        return {None: True, "qkv_bias": dims.qkv_bias, "untied": not dims.tied, "qk_norm": dims.qk_norm,
                "dense": not dims.num_experts, "shared": dims.shared_ffn > 0,
                "shared_gate": dims.shared_gate}[self.when]

    def hf_names(self, layer: int | None, expert: int | None = None) -> tuple[str, ...]:
        return tuple(n.format(i=layer, e=expert) for n in self.hf)


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
         (("f", "h"), ("f", "h")), ("2f", "h"), "gated_mlp", when="dense"),
    Rule("decoder.layers.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), (("h", "f"),), ("h", "f"),
         when="dense"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), (("h",),), ("h",)),
    Rule("output_layer.weight", ("lm_head.weight",), (("v", "h"),), ("vp", "h"), "vocab", when="untied",
         vocab_rows=True),
)

# Per-layer modules whose `_extra_state` Megatron saves as a ShardedObject (None for the local spec,
# FP8 metadata for transformer-engine) and insists on finding when it loads. Written as None; the
# superset of the local and transformer-engine specs, so either loads the checkpoint.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")


def _experts(router: str, prefix: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """The router and the routed experts: `prefix` holds the experts ({e}), gate/up/down name their linears."""
    fc = "decoder.layers.mlp.experts.experts.linear_fc"
    return (
        Rule("decoder.layers.mlp.router.weight", (router,), (("E", "h"),), ("E", "h")),
        Rule(f"{fc}1.weight", (f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight"), (("ef", "h"), ("ef", "h")),
             ("2ef", "h"), "gated_mlp", per_expert=True),
        Rule(f"{fc}2.weight", (f"{prefix}.{down}.weight",), (("h", "ef"),), ("h", "ef"), per_expert=True),
    )


_SHARED = "decoder.layers.mlp.shared_experts"
MIXTRAL = LLAMA + _experts("model.layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.block_sparse_moe."
                           "experts.{e}", "w1", "w3", "w2")
QWEN_MOE = LLAMA + _experts(f"{_MLP}.gate.weight", f"{_MLP}.experts.{{e}}", "gate_proj", "up_proj", "down_proj") + (
    Rule(f"{_SHARED}.linear_fc1.weight", (f"{_MLP}.shared_expert.gate_proj.weight",
                                          f"{_MLP}.shared_expert.up_proj.weight"),
         (("sf", "h"), ("sf", "h")), ("2sf", "h"), "gated_mlp", when="shared"),
    Rule(f"{_SHARED}.linear_fc2.weight", (f"{_MLP}.shared_expert.down_proj.weight",), (("h", "sf"),), ("h", "sf"),
         when="shared"),
    Rule(f"{_SHARED}.gate_weight", (f"{_MLP}.shared_expert_gate.weight",), (("1", "h"),), ("1", "h"),
         when="shared_gate"),
)

TABLES: dict[str, tuple[Rule, ...]] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA,
                                       "mixtral": MIXTRAL, "qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE}


def extra_state_modules(dims: Dims) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-layer modules, per-expert modules) whose empty `_extra_state` a checkpoint of this model carries."""
    if not dims.num_experts:
        return EXTRA_STATE_MODULES, ()
    layer = EXTRA_STATE_MODULES[:3] + (("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
                                       if dims.shared_ffn else ())
    return layer, ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")

# Hugging Face tensors that carry no weights (buffers some old exports include).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Item:
    """One unit of conversion: a Megatron tensor (one layer's slice) and its Hugging Face sources."""

    rule: Rule
    layer: int | None
    expert: int | None = None

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.rule.hf_names(self.layer, self.expert)

    @property
    def label(self) -> str:
        where = [str(i) for i in (self.layer, self.expert) if i is not None]
        return f"{self.rule.mcore}[{', '.join(where)}]" if where else self.rule.mcore


def items(table: tuple[Rule, ...], dims: Dims) -> Iterator[Item]:
    """Every conversion unit, layer by layer (the order of a Hugging Face checkpoint)."""
    rules = [r for r in table if r.applies(dims)]
    yield from (Item(r, None) for r in rules if not r.per_layer and r.mcore.startswith("embedding."))
    for i in range(dims.num_layers):
        for r in (r for r in rules if r.per_layer):
            yield from (Item(r, i, e) for e in range(dims.num_experts)) if r.per_expert else (Item(r, i),)
    yield from (Item(r, None) for r in rules if not r.per_layer and not r.mcore.startswith("embedding."))
