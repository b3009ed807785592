"""Conversion mapping: named transforms, name tables, Hugging Face configs <-> ModelConfig."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megalaunch.config.schema import ModelConfig
from megalaunch.conversion import families
from megalaunch.conversion.dims import Dims, padded_vocab_size
from megalaunch.conversion.errors import ConversionError, UnsupportedModelError
from megalaunch.conversion.tables import TABLES, items

torch = pytest.importorskip("torch")
from megalaunch.conversion.transforms import Block, blocks, to_hf, to_mcore  # noqa: E402

LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
             "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16"}


def dims(heads: int = 4, groups: int = 2, hidden: int = 64, **kw: object) -> Dims:
    base = dict(num_layers=2, hidden=hidden, ffn=128, heads=heads, groups=groups, head_dim=hidden // heads,
                vocab=300, padded_vocab=384, tied=False, qkv_bias=False)
    return Dims(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (4, 2), (4, 1), (8, 2)])
def test_qkv_round_trip_and_megatron_interleave(heads: int, groups: int) -> None:
    d = dims(heads=heads, groups=groups)
    hd = d.head_dim
    q = torch.randn(heads * hd, 64)
    k = torch.randn(groups * hd, 64)
    v = torch.randn(groups * hd, 64)
    fused = to_mcore("qkv", d, [q, k, v], ((heads + 2 * groups) * hd, 64))
    # Megatron's layout: per group g, its query heads, then k_g, then v_g.
    per = heads // groups
    block = (per + 2) * hd
    for g in range(groups):
        rows = fused[g * block:(g + 1) * block]
        assert torch.equal(rows[: per * hd], q[g * per * hd:(g + 1) * per * hd])
        assert torch.equal(rows[per * hd: per * hd + hd], k[g * hd:(g + 1) * hd])
        assert torch.equal(rows[per * hd + hd:], v[g * hd:(g + 1) * hd])
    shapes = [tuple(t.shape) for t in (q, k, v)]
    back = to_hf("qkv", d, fused, shapes)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    bias = [torch.randn(t.shape[0]) for t in (q, k, v)]
    fused_bias = to_mcore("qkv", d, bias, (fused.shape[0],))
    assert all(torch.equal(a, b) for a, b in zip(to_hf("qkv", d, fused_bias, [(s[0],) for s in shapes]), bias,
                                                strict=True))
    # every Megatron row comes from exactly one Hugging Face row
    covered = sorted(r for b in blocks("qkv", d, [s[0] for s in shapes], fused.shape[0])
                     for r in range(b.dest, b.dest + b.rows))
    assert covered == list(range(fused.shape[0]))


def test_gated_mlp_is_gate_then_up() -> None:
    gate, up = torch.randn(128, 64), torch.randn(128, 64)
    fused = to_mcore("gated_mlp", dims(), [gate, up], (256, 64))
    assert torch.equal(fused[:128], gate) and torch.equal(fused[128:], up)
    assert all(torch.equal(a, b) for a, b in zip(to_hf("gated_mlp", dims(), fused, [(128, 64)] * 2), (gate, up),
                                                strict=True))
    assert blocks("gated_mlp", dims(), [128, 128], 256) == [Block(0, 0, 128, 0), Block(1, 0, 128, 128)]


def test_vocab_padding_is_zero_and_stripped_exactly() -> None:
    emb = torch.randn(300, 64, dtype=torch.bfloat16)
    padded = to_mcore("vocab", dims(), [emb], (384, 64))
    assert padded.shape == (384, 64) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:300], emb) and not padded[300:].any()
    (back,) = to_hf("vocab", dims(), padded, [(300, 64)])
    assert torch.equal(back, emb)
    (grown,) = to_hf("vocab", dims(vocab=400, padded_vocab=400), padded, [(400, 64)])  # fewer rows than HF
    assert grown.shape == (400, 64) and torch.equal(grown[:384], padded)


def test_padded_vocab_size_matches_megatron() -> None:
    assert padded_vocab_size(300, 128) == 384
    assert padded_vocab_size(300, 128, 2) == 512
    assert padded_vocab_size(512, 64) == 512
    assert padded_vocab_size(128256, 128, 8) == 129024


@pytest.mark.parametrize(("tied", "qkv_bias", "expected"), [(False, False, 15), (True, False, 14), (True, True, 16)])
def test_table_items_follow_the_conditions(tied: bool, qkv_bias: bool, expected: int) -> None:
    work = list(items(TABLES["llama"], dims(tied=tied, qkv_bias=qkv_bias)))
    assert len(work) == expected
    keys = {i.rule.mcore for i in work}
    assert ("output_layer.weight" in keys) is not tied
    assert ("decoder.layers.self_attention.linear_qkv.bias" in keys) is qkv_bias
    assert work[0].rule.mcore == "embedding.word_embeddings.weight"
    assert work[1].hf_names == ("model.layers.0.input_layernorm.weight",)
    names = [n for i in work for n in i.hf_names]
    assert len(names) == len(set(names))


def test_every_rule_shape_is_consistent_with_its_transform() -> None:
    d = dims(tied=False, qkv_bias=True)
    for item in items(TABLES["llama"], d):
        hf_rows = [d.shape(s)[0] for s in item.rule.hf_shapes]
        mcore_rows = d.shape(item.rule.mcore_shape)[0]
        covered = sorted(r for b in blocks(item.rule.transform, d, hf_rows, mcore_rows)
                         for r in range(b.dest, b.dest + b.rows))
        expected = d.vocab if item.rule.vocab_rows else mcore_rows
        assert covered == list(range(expected)), item.label
        assert all(d.shape(s)[1:] == d.shape(item.rule.mcore_shape)[1:] for s in item.rule.hf_shapes), item.label


@pytest.mark.parametrize(("arch", "extra", "family", "qkv_bias"), [
    ("LlamaForCausalLM", {}, "llama", False),
    ("MistralForCausalLM", {"model_type": "mistral", "sliding_window": None}, "mistral", False),
    ("Qwen2ForCausalLM", {"model_type": "qwen2", "use_sliding_window": False}, "qwen2", True),
])
def test_model_from_hf_config(arch: str, extra: dict[str, object], family: str, qkv_bias: bool) -> None:
    hf = families.model_from_hf_config({**LLAMA_CFG, "architectures": [arch], **extra})
    assert hf.family == family and hf.vocab_size == 300 and hf.dtype == "bfloat16"
    m = hf.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == \
        (2, 64, 128, 4, 2)
    assert m.add_qkv_bias is qkv_bias and m.untie_embeddings_and_output_weights and m.norm_epsilon == 1e-5
    assert not hf.notes


def test_llama31_rope_scaling_and_transformers4_keys() -> None:
    cfg = {k: v for k, v in LLAMA_CFG.items() if k != "rope_parameters"}
    cfg.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    m = families.model_from_hf_config(cfg).model
    assert m.use_rope_scaling and m.rotary_base == 500000 and m.rope_scaling_factor == 8.0
    cfg["rope_scaling"]["factor"] = 32.0  # Llama 3.2
    assert families.model_from_hf_config(cfg).model.rope_scaling_factor == 32.0


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "no Megatron mapping"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, "low_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "n_routed_experts": 160},
     "(DeepSeek-V2: softmax scores with per-group maxima"),
    ({"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "num_experts": 64},
     "['OlmoeForCausalLM'] (a mixture of experts the mapping does not know)"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8}, "moe_intermediate_size"),
    ({"head_dim": None, "hidden_size": 60, "num_attention_heads": 8}, "no head_dim"),
    ({"hidden_act": "gelu"}, "silu"),
])
def test_unsupported_configs_name_the_problem(change: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        families.model_from_hf_config({**LLAMA_CFG, **change})
    assert message in str(e.value)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value) and "\n" not in str(e.value)


QWEN3_CFG = {**LLAMA_CFG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
             "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True}


def test_qwen3_reads_head_dim_and_qk_norm() -> None:
    hf = families.model_from_hf_config(QWEN3_CFG)
    m = hf.model
    assert hf.family == "qwen3" and not hf.notes
    assert (m.kv_channels, m.qk_layernorm, m.add_qkv_bias, m.untie_embeddings_and_output_weights) == \
        (32, True, False, False)
    assert (m.rotary_base, m.norm_epsilon) == (1000000, 1e-6)
    # Qwen3-8B's head size equals hidden / heads: kv_channels is still explicit, and equal to a recipe without it
    same = families.model_from_hf_config({**QWEN3_CFG, "head_dim": 16}).model
    assert same.kv_channels == 16
    assert families.differences(dataclasses.replace(same, kv_channels=None), same) == []
    assert [d[0] for d in families.differences(dataclasses.replace(m, kv_channels=None), m)] == ["kv_channels"]
    assert [d[0] for d in families.differences(dataclasses.replace(m, qk_layernorm=False), m)] == ["qk_layernorm"]


def test_qwen3_table_maps_the_per_head_norms() -> None:
    d = Dims.from_model(families.model_from_hf_config(QWEN3_CFG).model, vocab=300)
    assert (d.head_dim, d.qk_norm, d.tied) == (32, True, True)
    work = {i.rule.mcore: i for i in items(TABLES["qwen3"], d) if i.layer in (None, 1)}
    q = work["decoder.layers.self_attention.q_layernorm.weight"]
    assert q.hf_names == ("model.layers.1.self_attn.q_norm.weight",) and d.shape(q.rule.mcore_shape) == (32,)
    assert work["decoder.layers.self_attention.k_layernorm.weight"].hf_names == ("model.layers.1.self_attn.k_norm.weight",)
    qkv = work["decoder.layers.self_attention.linear_qkv.weight"]
    assert d.shape(qkv.rule.mcore_shape) == ((4 + 2 * 2) * 32, 64)  # the attention is 128 wide, hidden is 64
    assert d.shape(work["decoder.layers.self_attention.linear_proj.weight"].rule.mcore_shape) == (64, 128)
    assert "output_layer.weight" not in work
    llama = {i.rule.mcore for i in items(TABLES["llama"], dims())}
    assert not {k for k in llama if "q_layernorm" in k or "k_layernorm" in k}


def test_head_dim_other_than_hidden_over_heads_maps_for_mistral_too() -> None:
    """Mistral Nemo's shape (head_dim x heads != hidden): kv_channels, no QK-norm."""
    hf = families.model_from_hf_config({**LLAMA_CFG, "architectures": ["MistralForCausalLM"], "head_dim": 32})
    assert (hf.model.kv_channels, hf.model.qk_layernorm) == (32, False)
    assert families.model_from_hf_config(LLAMA_CFG).model.kv_channels is None  # 16 x 4 == 64


def test_mistral_sliding_window_is_a_note() -> None:
    hf = families.model_from_hf_config({**LLAMA_CFG, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert "sliding_window" in hf.notes[0]


def test_differences_name_fields_and_ignore_training_choices() -> None:
    hf = families.model_from_hf_config(LLAMA_CFG).model
    recipe = dataclasses.replace(hf, seq_length=64, max_position_embeddings=64, make_vocab_size_divisible_by=64)
    assert families.differences(recipe, hf) == []
    wrong = dataclasses.replace(recipe, num_layers=3, norm_epsilon=1e-6)
    assert [d[0] for d in families.differences(wrong, hf)] == ["num_layers", "norm_epsilon"]
    assert families.differences(dataclasses.replace(hf, num_query_groups=None, num_attention_heads=4),
                                dataclasses.replace(hf, num_query_groups=4)) == []


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("scaling", [False, True])
def test_hf_config_from_model_round_trips(family: str, scaling: bool) -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        rotary_base=500000, use_rope_scaling=scaling, rope_scaling_factor=32.0 if scaling else 8.0, add_qkv_bias=family == "qwen2",
                        untie_embeddings_and_output_weights=family != "qwen2", max_position_embeddings=64,
                        seq_length=64, qk_layernorm=family == "qwen3", kv_channels=32 if family == "qwen3" else None)
    cfg = families.hf_config_from_model(model, family=family, vocab_size=512, dtype="float32")
    back = families.model_from_hf_config(cfg)
    assert back.family == family and back.vocab_size == 512
    assert families.differences(model, back.model) == []
    assert cfg["head_dim"] == (32 if family == "qwen3" else 16)


def test_hf_config_from_model_refuses_what_does_not_fit() -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, add_qkv_bias=True)
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        families.hf_config_from_model(model, family="llama", vocab_size=10, dtype="float32")
    with pytest.raises(UnsupportedModelError):
        families.hf_config_from_model(dataclasses.replace(model, swiglu=False), family="qwen2", vocab_size=10,
                                      dtype="float32")
    plain = dataclasses.replace(model, add_qkv_bias=False)
    with pytest.raises(UnsupportedModelError, match="qk_layernorm=False does not fit family 'qwen3'"):
        families.hf_config_from_model(plain, family="qwen3", vocab_size=10, dtype="float32")
    with pytest.raises(UnsupportedModelError, match="qk_layernorm=True does not fit family 'llama'"):
        families.hf_config_from_model(dataclasses.replace(plain, qk_layernorm=True), family="llama", vocab_size=10,
                                      dtype="float32")


def test_dims_refuse_inconsistent_shapes() -> None:
    with pytest.raises(ConversionError, match="query groups"):
        dims(heads=4, groups=3)
    model = ModelConfig(num_layers=1, hidden_size=60, num_attention_heads=8)
    with pytest.raises(ConversionError, match="hidden_size"):
        Dims.from_model(model, vocab=10)
    nemo = dataclasses.replace(model, kv_channels=16, num_query_groups=2)
    assert Dims.from_model(nemo, vocab=10).shape(("q", "kv", "d")) == (128, 32, 16)  # 8 heads, 2 groups of 16


# The published Qwen3 dense config.json values: (layers, hidden, intermediate, heads, tied)
QWEN3_PUBLISHED = {"0.6b": (28, 1024, 3072, 16, True), "1.7b": (28, 2048, 6144, 16, True),
                   "4b": (36, 2560, 9728, 32, True), "8b": (36, 4096, 12288, 32, False),
                   "14b": (40, 5120, 17408, 40, False), "32b": (64, 5120, 25600, 64, False)}


@pytest.mark.parametrize("size", sorted(QWEN3_PUBLISHED))
def test_shipped_qwen3_recipes_describe_the_published_models(size: str, tmp_path: Path) -> None:
    """hf-to-mcore --recipe qwen3-SIZE on the published checkpoint finds no differing field, and the config
    written back has the published head size, width and ties."""
    from megalaunch.config.loader import load_recipe

    layers, hidden, ffn, heads, tied = QWEN3_PUBLISHED[size]
    published = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": ffn,
                 "max_position_embeddings": 40960, "max_window_layers": layers, "model_type": "qwen3",
                 "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": 8,
                 "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                 "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "use_sliding_window": False,
                 "vocab_size": 151936}
    hf = families.model_from_hf_config(published)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [models/qwen3-{size}, training/pretrain, clusters/slurm]\nname: m\n"
                      "data: {mock: true, vocab_size: 151936}\n")
    model = load_recipe(str(recipe)).recipe.model
    assert families.differences(model, hf.model) == []
    back = families.hf_config_from_model(model, family="qwen3", vocab_size=151936, dtype="bfloat16")
    keys = ("head_dim", "hidden_size", "intermediate_size", "num_attention_heads", "tie_word_embeddings")
    assert {k: back[k] for k in keys} == {k: published[k] for k in keys}
