"""The planner's mixture-of-experts model (config/planner/moe.py, shape.py, memory.py, plan.py): the terms by
hand on a small config, Megatron's FLOP count evaluated independently, `parallel: auto` choosing EP, the dry run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megalaunch.cli.main import main
from megalaunch.config.loader import load_recipe
from megalaunch.config.planner import moe
from megalaunch.config.planner.fit import model_shape
from megalaunch.config.planner.gpus import gpu_spec
from megalaunch.config.planner.memory import Layout, ModelShape, estimate, stage_params
from megalaunch.config.planner.plan import flops_per_token, predict

# tiny-moe's shape: 2 layers of 64, 4 heads / 2 KV, 8 experts of 64, top-2, vocab 512, seq 64
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64, vocab_divisible_by=64,
                  experts=8, topk=2, expert_ffn=64, moe_pattern=(1, 1))
EXPERTS_PER_LAYER = 8 * 3 * 64 * 64  # 98,304
DENSE = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 64 * 8 + 2 * 64) + 2 * 512 * 64 + 64  # attention, router, norms; 91,456


def test_parameters_by_hand_and_from_the_recipe() -> None:
    assert TINY.expert_params == EXPERTS_PER_LAYER
    assert stage_params(TINY, Layout(ep=2, etp=1, dp=4), 0) == DENSE
    assert TINY.total_params() == DENSE + 2 * EXPERTS_PER_LAYER == 288_064
    assert model_shape(load_recipe("tiny-moe").recipe, 512).total_params() == 288_064


def test_ep_halves_expert_weights_and_grads_and_the_optimizer_state_follows_the_expert_dp_group() -> None:
    """4 GPUs: EP 2 -> 4 holds half the experts (98,304 -> 49,152 parameters for 2 layers). The distributed
    optimizer splits their state over expert DP = 4 / EP, so per GPU it stays 12 x 196,608 / 4 bytes; without it
    EP halves the state too."""
    two, four = (estimate(TINY, Layout(dp=4, ep=ep, etp=1, num_microbatches=1)) for ep in (2, 4))
    assert two.params - four.params == 2 * 49_152
    assert two.grads - four.grads == 4 * 49_152
    assert two.optimizer == four.optimizer == 12 * DENSE / 4 + 12 * 2 * EXPERTS_PER_LAYER / 4
    plain = [estimate(TINY, Layout(dp=4, ep=ep, etp=1, distributed_optimizer=False)) for ep in (2, 4)]
    assert plain[0].optimizer - plain[1].optimizer == 12 * 49_152
    assert Layout(tp=2, dp=4, ep=4, etp=1).expert_dp == 2  # world 8 / (ETP 1 x EP 4 x PP 1)


def test_moe_activations_by_hand() -> None:
    """64 tokens x top-2 routed, x 1.25 (dropless) at EP 2: 160 rows; experts 3 x 64 bf16, dispatch in and out
    64 bf16 each, router 8 experts x 8 bytes per token. A capacity factor of 1 bounds the load at the mean; EP 1
    has no imbalance."""
    fused = Layout(ep=2, etp=1, fused=True)
    assert moe.moe_mlp_bytes(TINY, fused) == 160 * 3 * 64 * 2 + 160 * 64 * 2 * 2 + 64 * 8 * 8
    capped = dataclasses.replace(TINY, capacity=1.0)
    assert moe.moe_mlp_bytes(capped, fused) == 128 * 3 * 64 * 2 + 128 * 64 * 2 * 2 + 64 * 8 * 8
    assert moe.load(TINY, Layout(ep=1, etp=1)) == 1.0
    assert moe.moe_mlp_bytes(TINY, dataclasses.replace(fused, micro_batch=2)) == 2 * moe.moe_mlp_bytes(TINY, fused)


def _megatron_flops_per_token(*, layers: int, hidden: int, heads: int, groups: int, kv_channels: int, ffn: int,
                              moe_ffn: int, topk: int, shared: int, moe_layers: int, vocab: int, seq: int) -> float:
    """megatron/training/training.py's num_floating_point_operations (transformer_flops, BSHD), per token."""
    q, kv = kv_channels * heads, kv_channels * groups
    mlp = 3 * 2 * hidden * ((ffn * 3) * (layers - moe_layers) + (moe_ffn * topk * 3) * moe_layers
                            + (shared * 3) * moe_layers)
    attn = 3 * 2 * (hidden * (q + 2 * kv) + q * hidden) * layers
    logits = 3 * 2 * hidden * vocab
    core = 3 * 2 * q / 2 * 2 * layers * seq  # seq^2 per sequence over seq tokens
    return mlp + attn + logits + core


def test_flops_per_token_equal_megatrons_for_qwen3_30b_a3b_and_kv_channels() -> None:
    shape = model_shape(load_recipe("qwen3-30b-a3b").recipe, 151936)
    assert shape.head_dim == 128 and shape.q_size == 4096  # not hidden / heads = 64
    want = _megatron_flops_per_token(layers=48, hidden=2048, heads=32, groups=4, kv_channels=128, ffn=6144,
                                     moe_ffn=768, topk=8, shared=0, moe_layers=48, vocab=151936, seq=4096)
    assert flops_per_token(shape) == pytest.approx(want, rel=1e-12)
    first_dense = dataclasses.replace(shape, moe_pattern=(0, 0, *[1] * 46), shared_ffn=1024)
    want = _megatron_flops_per_token(layers=48, hidden=2048, heads=32, groups=4, kv_channels=128, ffn=6144,
                                     moe_ffn=768, topk=8, shared=1024, moe_layers=46, vocab=151936, seq=4096)
    assert flops_per_token(first_dense) == pytest.approx(want, rel=1e-12)


def test_speed_terms() -> None:
    """The token exchange: none at EP 1, inside a node at NVLink speed, across nodes at the InfiniBand's."""
    shape = model_shape(load_recipe("qwen3-30b-a3b").recipe, 151936)
    layout = Layout(dp=8, ep=8, etp=1, num_microbatches=4)
    assert moe.a2a_seconds(shape, dataclasses.replace(layout, ep=1), 48, 360, 40, 8) == 0
    inside, across = (moe.a2a_seconds(shape, layout, 48, 360, 40, g) for g in (8, 4))
    # 4096 tokens x top-8 x 2048 x 2 bytes x 2 (dispatch, combine) x 2 (forward, backward) x 7/8, 48 layers
    assert inside == pytest.approx(48 * 4096 * 8 * 2048 * 8 * 7 / 8 / (360 * moe.EP_NVLINK_FRACTION * 1e9))
    assert across / inside == pytest.approx(360 * moe.EP_NVLINK_FRACTION / 40)
    parts = predict(shape, layout, gpu_spec("H200"), gpus_per_node=8)
    assert parts["ep"] == pytest.approx(inside * 4)


def test_auto_picks_an_ep_that_divides_the_experts_and_dp_and_sp_with_tp() -> None:
    for sets in ([], ["parallel.tensor_model_parallel_size=2"]):
        loaded = load_recipe("qwen3-30b-a3b", sets)
        p = loaded.recipe.parallel
        assert loaded.layout is not None and loaded.layout.planned, loaded.layout
        dp_cp = 16 // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
        assert 128 % p.expert_model_parallel_size == 0 and dp_cp % p.expert_model_parallel_size == 0
        assert p.expert_tensor_parallel_size == 1
        assert p.sequence_parallel == (p.tensor_model_parallel_size > 1)
        assert f"EP {p.expert_model_parallel_size}" in loaded.layout.layout


def test_the_dry_run_shows_ep_memory_time_and_gpu_hours(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sets = ["cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gpu=H200", f"run.root={tmp_path}"]
    main(["submit", "qwen3-30b-a3b", "--dry-run", *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr().out
    layout = next(line for line in out.splitlines() if line.startswith("layout: "))
    assert " x EP " in layout and "(parallel: auto)" in layout and "GiB per GPU" in layout and "s per step" in layout
    assert "GPU-hours" in out
