"""The sizes a conversion needs, derived once from a ModelConfig and the vocabulary.

Name tables write tensor shapes with the symbols of `Dims.symbols()` (``("qkv", "h")``), so a table
stays declarative and one place does the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.errors import ConversionError


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Megatron's padding: the next multiple of make_vocab_size_divisible_by x TP."""
    multiple = max(divisible_by, 1) * max(tensor_parallel, 1)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class Dims:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    """Rows of the Hugging Face embedding (its config's vocab_size)."""
    padded_vocab: int
    """Rows of the Megatron embedding (vocab padded to make_vocab_size_divisible_by x TP)."""
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    """An RMSNorm over head_dim on each head's queries and keys (Qwen3; Megatron's q_layernorm/k_layernorm)."""
    num_experts: int = 0
    """Routed experts per layer (0: a dense model; an MoE model has them in every layer)."""
    expert_ffn: int = 0
    """Each routed expert's MLP width."""
    shared_ffn: int = 0
    """The shared expert's MLP width (0: none)."""
    shared_gate: bool = False
    """A sigmoid gate [1, hidden] on the shared expert's output (Qwen2-MoE)."""
    expert_bias: bool = False
    """The router's per-expert score bias (DeepSeek-V3's e_score_correction_bias; fp32)."""
    moe_pattern: tuple[int, ...] = ()
    """Per layer 1 (MoE) or 0 (dense) where an MoE model has dense layers (DeepSeek-V3's first 3); empty where
    every layer is the same kind. Megatron then saves every layer under its own keys (`decoder.layers.{i}.`)."""
    mla: tuple[int, int, int, int, int] | None = None
    """Multi-latent attention: (q_lora_rank (0: full-rank queries), kv_lora_rank, qk nope, qk rope, v head size)."""

    @property
    def layer_keys(self) -> bool:
        """Megatron's per-layer keys (layers of two kinds) rather than one key stacked over the layer axis."""
        return bool(self.moe_pattern)

    def __post_init__(self) -> None:
        if self.heads % self.groups:
            raise ConversionError(f"{self.heads} attention heads do not divide into {self.groups} query groups",
                                  field="model.num_query_groups")
        if self.padded_vocab < self.vocab:
            raise ConversionError(f"padded vocabulary {self.padded_vocab} is smaller than the vocabulary {self.vocab}")

    @classmethod
    def from_model(cls, model: ModelConfig, *, vocab: int, padded_vocab: int | None = None,
                   tensor_parallel: int = 1) -> Dims:
        if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
            raise ConversionError(f"hidden_size {model.hidden_size} is not a multiple of "
                                  f"{model.num_attention_heads} heads", field="model.hidden_size",
                                  fix="set model.kv_channels (the head size)")
        if padded_vocab is None:
            padded_vocab = padded_vocab_size(vocab, model.make_vocab_size_divisible_by, tensor_parallel)
        return cls(num_layers=model.num_layers, hidden=model.hidden_size,
                   ffn=model.ffn_hidden_size or 4 * model.hidden_size,
                   heads=model.num_attention_heads,
                   groups=model.num_query_groups or model.num_attention_heads,
                   head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
                   vocab=vocab, padded_vocab=padded_vocab,
                   tied=not model.untie_embeddings_and_output_weights, qkv_bias=model.add_qkv_bias,
                   qk_norm=model.qk_layernorm, num_experts=model.num_experts or 0,
                   expert_ffn=(model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size)
                   if model.num_experts else 0,
                   shared_ffn=(model.moe_shared_expert_intermediate_size or 0) if model.num_experts else 0,
                   shared_gate=bool(model.num_experts and model.moe_shared_expert_gate),
                   expert_bias=bool(model.num_experts and model.moe_router_enable_expert_bias),
                   moe_pattern=_moe_pattern(model), mla=_mla(model))

    def symbols(self) -> dict[str, int]:
        q = self.heads * self.head_dim
        kv = self.groups * self.head_dim
        ql, kl, nope, rope, v = self.mla or (0, 0, 0, 0, 0)
        mla = {"ql": ql, "kl": kl, "klr": kl + rope, "qh": self.heads * (nope + rope),
               "kvh": self.heads * (nope + v), "o": self.heads * v}
        return {**mla, "h": self.hidden, "f": self.ffn, "2f": 2 * self.ffn, "q": q, "kv": kv,
                "qkv": q + 2 * kv, "d": self.head_dim, "v": self.vocab, "vp": self.padded_vocab, "L": self.num_layers,
                "E": self.num_experts, "ef": self.expert_ffn, "2ef": 2 * self.expert_ffn, "sf": self.shared_ffn,
                "2sf": 2 * self.shared_ffn, "1": 1}

    def shape(self, symbolic: tuple[str, ...]) -> tuple[int, ...]:
        table = self.symbols()
        return tuple(table[s] for s in symbolic)


def _moe_pattern(model: ModelConfig) -> tuple[int, ...]:
    from megalaunch.config.model.moe import moe_layer_pattern

    pattern = tuple(moe_layer_pattern(model)) if model.num_experts else ()
    return pattern if 0 in pattern else ()


def _mla(model: ModelConfig) -> tuple[int, int, int, int, int] | None:
    if not model.multi_latent_attention:
        return None
    return (model.q_lora_rank or 0, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim,
            model.v_head_dim)
