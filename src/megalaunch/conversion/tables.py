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
    own_dtype: bool = False
    """Kept in its own dtype both ways, whatever the model's (DeepSeek-V3's router weight and expert bias: fp32 in
    transformers' model; Megatron casts the weight to its parameters' dtype when it loads, keeps the bias fp32)."""

    @property
    def per_layer(self) -> bool:
        return self.mcore.startswith("decoder.layers.")

    def applies(self, dims: Dims) -> bool:
        return {None: True, "qkv_bias": dims.qkv_bias, "untied": not dims.tied, "qk_norm": dims.qk_norm,
                "dense": not dims.num_experts, "shared": dims.shared_ffn > 0,
                "shared_gate": dims.shared_gate, "q_lora": bool(dims.mla and dims.mla[0]),
                "no_q_lora": bool(dims.mla and not dims.mla[0]), "expert_bias": dims.expert_bias}[self.when]

    def in_layer(self, dims: Dims, layer: int) -> bool:
        """Whether layer `layer` has this tensor: where an MoE model has dense layers (`dims.moe_pattern`), the
        router and experts are in its MoE layers only, the dense MLP in its dense layers only."""
        if not dims.moe_pattern:
            return True
        if self.mcore.startswith(("decoder.layers.mlp.router", "decoder.layers.mlp.experts",
                                  "decoder.layers.mlp.shared_experts")):
            return dims.moe_pattern[layer] == 1
        return dims.moe_pattern[layer] == 0 if self.mcore.startswith("decoder.layers.mlp.linear_fc") else True

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

# DeepSeek-V3: multi-latent attention on Megatron's local MLA spec (its norms are modules of their own, saved as
# `input_layernorm` / `pre_mlp_layernorm`, not under the fused linears' names), the first k layers dense, then a
# sigmoid router with its fp32 expert bias, the routed experts and one shared expert. Both sides lay out q_b_proj's
# heads as [nope, rope] and kv_a_proj_with_mqa as [latent, rope], and rotate the rope part's interleaved pairs the
# same way (Megatron's mla_rotary_interleaved, transformers' rope_interleave), so every tensor is a copy.
_LAYER = "model.layers.{i}"
_SA = "decoder.layers.self_attention"
DEEPSEEK_V3: tuple[Rule, ...] = (
    LLAMA[0],
    Rule("decoder.layers.input_layernorm.weight", (f"{_LAYER}.input_layernorm.weight",), (("h",),), ("h",)),
    Rule(f"{_SA}.linear_q_down_proj.weight", (f"{_ATTN}.q_a_proj.weight",), (("ql", "h"),), ("ql", "h"), when="q_lora"),
    Rule(f"{_SA}.q_layernorm.weight", (f"{_ATTN}.q_a_layernorm.weight",), (("ql",),), ("ql",), when="q_lora"),
    Rule(f"{_SA}.linear_q_up_proj.weight", (f"{_ATTN}.q_b_proj.weight",), (("qh", "ql"),), ("qh", "ql"), when="q_lora"),
    Rule(f"{_SA}.linear_q_proj.weight", (f"{_ATTN}.q_proj.weight",), (("qh", "h"),), ("qh", "h"), when="no_q_lora"),
    Rule(f"{_SA}.linear_kv_down_proj.weight", (f"{_ATTN}.kv_a_proj_with_mqa.weight",), (("klr", "h"),), ("klr", "h")),
    Rule(f"{_SA}.kv_layernorm.weight", (f"{_ATTN}.kv_a_layernorm.weight",), (("kl",),), ("kl",)),
    Rule(f"{_SA}.linear_kv_up_proj.weight", (f"{_ATTN}.kv_b_proj.weight",), (("kvh", "kl"),), ("kvh", "kl")),
    Rule(f"{_SA}.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), (("h", "o"),), ("h", "o")),
    Rule("decoder.layers.pre_mlp_layernorm.weight", (f"{_LAYER}.post_attention_layernorm.weight",), (("h",),), ("h",)),
    Rule("decoder.layers.mlp.linear_fc1.weight", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
         (("f", "h"), ("f", "h")), ("2f", "h"), "gated_mlp"),
    Rule("decoder.layers.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), (("h", "f"),), ("h", "f")),
    Rule("decoder.layers.mlp.router.weight", (f"{_MLP}.gate.weight",), (("E", "h"),), ("E", "h"), own_dtype=True),
    *_experts(f"{_MLP}.gate.weight", f"{_MLP}.experts.{{e}}", "gate_proj", "up_proj", "down_proj")[1:],
    Rule("decoder.layers.mlp.router.expert_bias", (f"{_MLP}.gate.e_score_correction_bias",), (("E",),), ("E",),
         when="expert_bias", own_dtype=True),
    Rule(f"{_SHARED}.linear_fc1.weight", (f"{_MLP}.shared_experts.gate_proj.weight",
                                          f"{_MLP}.shared_experts.up_proj.weight"),
         (("sf", "h"), ("sf", "h")), ("2sf", "h"), "gated_mlp", when="shared"),
    Rule(f"{_SHARED}.linear_fc2.weight", (f"{_MLP}.shared_experts.down_proj.weight",), (("h", "sf"),), ("h", "sf"),
         when="shared"),
    *LLAMA[-2:],
)

TABLES: dict[str, tuple[Rule, ...]] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA,
                                       "mixtral": MIXTRAL, "qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE,
                                       "deepseek_v3": DEEPSEEK_V3}


def extra_state_modules(dims: Dims) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-layer modules, per-expert modules) whose empty `_extra_state` a checkpoint of this model carries."""
    if not dims.num_experts:
        return EXTRA_STATE_MODULES, ()
    layer = EXTRA_STATE_MODULES[:3] + (("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
                                       if dims.shared_ffn else ())
    return layer, ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")

def layer_objects(dims: Dims) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(key, global shape, offset) of every empty `_extra_state` object of a model saved under per-layer keys
    (`dims.layer_keys`): per layer one object per linear module (shape (1,)), per routed expert one ([experts])."""
    out: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    q = ("linear_q_down_proj", "linear_q_up_proj") if dims.mla and dims.mla[0] else ("linear_q_proj",)
    attention = tuple(f"self_attention.{m}" for m in (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")) \
        if dims.mla else EXTRA_STATE_MODULES[:3]
    for i, moe in enumerate(dims.moe_pattern):
        mlp = (("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2") if dims.shared_ffn else ()) \
            if moe else EXTRA_STATE_MODULES[3:]
        out += [(f"decoder.layers.{i}.{m}._extra_state", (1,), (0,)) for m in (*attention, *mlp)]
        if moe:
            out += [(f"decoder.layers.{i}.mlp.experts.experts.linear_fc{n}._extra_state", (dims.num_experts,), (e,))
                    for n in (1, 2) for e in range(dims.num_experts)]
    return out


# Hugging Face tensors that carry no weights (buffers some old exports include).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Item:
    """One unit of conversion: a Megatron tensor (one layer's slice) and its Hugging Face sources."""

    rule: Rule
    layer: int | None
    expert: int | None = None
    own_key: bool = False
    """The layer's tensor has a key of its own (`decoder.layers.{i}.`, Dims.layer_keys), no stacked layer axis."""

    @property
    def key(self) -> str:
        """The Megatron checkpoint key."""
        if self.own_key and self.rule.per_layer:
            return f"decoder.layers.{self.layer}.{self.rule.mcore.removeprefix('decoder.layers.')}"
        return self.rule.mcore

    @property
    def stacked(self) -> bool:
        """On Megatron's stacked layer axis (the global tensor's first)."""
        return self.rule.per_layer and not self.own_key

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
    own = dims.layer_keys
    for i in range(dims.num_layers):
        for r in (r for r in rules if r.per_layer and r.in_layer(dims, i)):
            yield from (Item(r, i, e, own) for e in range(dims.num_experts)) if r.per_expert else (Item(r, i, None, own),)
    yield from (Item(r, None) for r in rules if not r.per_layer and not r.mcore.startswith("embedding."))
