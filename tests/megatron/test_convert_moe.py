"""Mixture-of-experts conversion (Mixtral, Qwen2-MoE, Qwen3-MoE) on tiny random models built with transformers
(no downloads): Hugging Face -> Megatron-core -> Hugging Face is bit-exact; the checkpoint is what GPTModel's
MoE layers ask for (SequentialMLP and megalaunch's grouped experts); Megatron's logits on the converted
checkpoint agree with transformers' (CPU fp32) when loaded with TP 1, with EP 2, with TP 2 + EP 2 and with
expert TP 2; a checkpoint the real trainer saved with EP 2 (each rank holding half of the experts) exports and
runs in transformers; and a model that would convert only in part is refused in one line, nothing written."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import torch
from harness import Trainer, make_run
from safetensors.torch import load_file, save_file
from tests.support import forkserver
from tests.support.hf_models import TINY, run_megatron_logits

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
from megalaunch.conversion.errors import ConversionError
from megalaunch.conversion.families import model_from_hf_config

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
MAX_ABS_DIFF = 1e-4
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# (family, tied embeddings, dtype): fp32 for the logits, one bf16 tied model for the round trip.
CASES = [(f, False, "float32") for f in FAMILIES] + [("mixtral", True, "bfloat16")]
IDS = ["mixtral", "qwen2_moe", "qwen3_moe", "mixtral-tied-bf16"]


def moe_config(family: str, *, tied: bool = False, **overrides: Any) -> Any:
    """4 experts, top-2, expert width 32. Qwen2-MoE: a gated shared expert of 48, QKV biases, softmax over all
    experts without renormalising (norm_topk_prob false, as published); Qwen3-MoE: head_dim 32 x 4 heads over a
    hidden size of 64, QK-norm, norm_topk_prob true (as published)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    base: dict[str, Any] = {**TINY, "vocab_size": VOCAB, "tie_word_embeddings": tied, "num_experts_per_tok": 2,
                            "rope_theta": 1000000.0}
    if family == "mixtral":
        return MixtralConfig(**{**base, "intermediate_size": 32, "num_local_experts": 4, **overrides})
    qwen = {**base, "moe_intermediate_size": 32, "num_experts": 4, "rms_norm_eps": 1e-6}
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**{**qwen, "shared_expert_intermediate_size": 48, "norm_topk_prob": False, **overrides})
    return Qwen3MoeConfig(**{**qwen, "head_dim": 32, "norm_topk_prob": True, **overrides})


def make_moe(path: Path, family: str, *, tied: bool = False, dtype: str = "float32", seed: int = 0) -> None:
    """Every tensor random (norms around 1, biases and the shared expert's gate too), so no mapping can hide."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, tied=tied), dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.eval().save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, str], Path]:
    out = {}
    for family, tied, dtype in CASES:
        root = tmp_path_factory.mktemp(f"{family}-{tied}-{dtype}")
        make_moe(root / "hf", family, tied=tied, dtype=dtype)
        hf_to_mcore(root / "hf", root / "mcore", progress=False)  # no recipe: the MoE fields from config.json
        out[(family, tied, dtype)] = root
    return out


def config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_round_trip_is_bit_exact(models: dict[Any, Path], case: tuple[str, bool, str], tmp_path: Path) -> None:
    root = models[case]
    hf = model_from_hf_config(config(root / "hf"))
    assert (hf.family, hf.model.num_experts, hf.model.moe_router_topk) == (case[0], 4, 2)
    report = mcore_to_hf(root / "mcore", tmp_path, progress=False)
    before, after = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and report.tensors == len(before)
    experts = [n for n in before if ".experts.3." in n]
    assert len(experts) == 2 * 3  # expert 3's gate, up and down in both layers
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert config(tmp_path)["architectures"] == config(root / "hf")["architectures"]


def _expected_layout(model: Any, experts: str) -> dict[str, tuple[int, ...]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    with megatron_parallel_state():
        sharded = build_gpt_model(model, vocab_size=VOCAB, experts=experts).sharded_state_dict()
    out = {}
    for v in nested_values(sharded):
        for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
            if isinstance(t, ShardedTensor | ShardedObject):
                out[t.key] = tuple(t.global_shape)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_layout_is_what_gptmodel_asks_for(models: dict[Any, Path], family: str) -> None:
    """Every tensor and `_extra_state` object the MoE GPTModel's sharded state dict names, with its global shape
    (experts: [layers, experts, ...]), for Megatron's SequentialMLP and megalaunch's grouped experts alike."""
    from torch.distributed.checkpoint import FileSystemReader

    root = models[(family, False, "float32")]
    model = model_from_hf_config(config(root / "hf")).model
    meta = FileSystemReader(str(root / "mcore" / "release")).read_metadata().state_dict_metadata
    found = {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}
    objects = {k.split("/shard_")[0] for k in meta if "_extra_state" in k}
    for experts in ("sequential", "grouped"):
        expected = _expected_layout(model, experts)
        assert {k: s for k, s in expected.items() if "_extra_state" not in k} == found, experts
        assert {k for k in expected if "_extra_state" in k} <= objects, experts
    assert found["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 4, 64, 64)
    assert found["decoder.layers.mlp.router.weight"] == (2, 4, 64)
    assert ("decoder.layers.mlp.shared_experts.gate_weight" in found) is (family == "qwen2_moe")


def hf_logits(path: Path, tokens: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits


def _tokens(batch: int = 2, seq: int = 96, seed: int = 1) -> list[list[int]]:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(models: dict[Any, Path], family: str, tmp_path: Path) -> None:
    root = models[(family, False, "float32")]
    model = dataclasses.asdict(model_from_hf_config(config(root / "hf")).model)
    tokens = _tokens()
    expected = hf_logits(root / "hf", tokens)
    ckpt = str(root / "mcore" / "release")
    got = run_megatron_logits(1, ckpt, model, VOCAB, tokens, str(tmp_path / "logits.pt"))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= MAX_ABS_DIFF
    if family == "qwen2_moe":  # negative control: renormalised top-k weights give clearly other logits
        wrong = run_megatron_logits(1, ckpt, {**model, "moe_router_topk_normalize": True}, VOCAB, tokens,
                                    str(tmp_path / "wrong.pt"))
        assert (wrong - expected).abs().max().item() > 100 * MAX_ABS_DIFF


LAYOUT_RANK = r"""
import dataclasses, json, os, sys, torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import build_gpt_model
from megalaunch.runtime.model import cpu_compat
cpu_compat.enable()
rank, port, ckpt, model, tp, ep, etp, tokens, result = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
model_parallel_cuda_manual_seed(1234)
gpt = build_gpt_model(ModelConfig(**model), vocab_size=300, sequence_parallel=tp > 1, tensor_model_parallel_size=tp,
                      expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                      moe_token_dispatcher_type="alltoall")
local = sorted({k.split(".local_experts.")[1].split(".")[0] for k in gpt.state_dict() if ".local_experts." in k})
missing = gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), ckpt), strict=False).missing_keys
assert not missing, missing  # the common state (args, iteration) comes back too: only missing keys matter
gpt.eval()
ids = torch.tensor(tokens)
pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
with torch.no_grad():
    logits = gpt(ids, pos, mask[None, None])
if rank == 0:
    torch.save(logits[..., :300].float(), result)
print(json.dumps({"rank": rank, "local_experts": local}))
dist.destroy_process_group()
"""


def _two_ranks(ckpt: Path, model: dict[str, Any], tp: int, ep: int, etp: int, tokens: list[list[int]],
               result: Path) -> list[dict[str, Any]]:
    from megalaunch.runtime.rank.dist_env import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([forkserver.python(), "-c", LAYOUT_RANK, json.dumps(
        [rank, port, str(ckpt), model, tp, ep, etp, tokens, str(result)])], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize(("family", "tp", "ep", "etp", "local"), [
    ("qwen3_moe", 1, 2, 1, [["0", "1"], ["0", "1"]]),
    ("qwen2_moe", 2, 2, 1, [["0", "1"], ["0", "1"]]),
    ("mixtral", 1, 1, 2, [["0", "1", "2", "3"]] * 2),
], ids=["ep2", "tp2-sp-ep2", "expert-tp2"])
def test_the_converted_checkpoint_loads_into_any_expert_layout(models: dict[Any, Path], family: str, tp: int, ep: int,
                                                               etp: int, local: list[list[str]], tmp_path: Path) -> None:
    """The converted checkpoint on two gloo ranks: EP 2 (two of the four experts on each rank), TP 2 with sequence
    parallelism and EP 2 (the shared expert split by TP, the experts by EP), expert TP 2 (every expert split): the
    logits are transformers'."""
    root = models[(family, False, "float32")]
    model = dataclasses.asdict(model_from_hf_config(config(root / "hf")).model)
    tokens = _tokens()
    ranks = _two_ranks(root / "mcore" / "release", model, tp, ep, etp, tokens, tmp_path / "logits.pt")
    assert [r["local_experts"] for r in sorted(ranks, key=lambda r: r["rank"])] == local
    got = torch.load(tmp_path / "logits.pt")
    assert (got - hf_logits(root / "hf", tokens)).abs().max().item() <= MAX_ABS_DIFF


@pytest.mark.parametrize("layout", ["parallel.expert_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
                         ids=["ep2", "pp2"])
def test_a_checkpoint_trained_in_parallel_exports_to_transformers(tmp_path: Path, layout: str) -> None:
    """tiny-moe trained 2 iterations on two gloo ranks, at EP 2 (each rank saved its 4 of the 8 experts) or PP 2
    (each rank one layer): the checkpoint, without any Hugging Face config, becomes a Mixtral (family from the
    Megatron arguments: no shared expert, no QK-norm) whose logits in transformers are Megatron's own on that
    checkpoint, and which generates."""
    from transformers import AutoModelForCausalLM

    paths = make_run(tmp_path / "runs", "training.train_iters=2", "checkpoint.save_interval=2",
                     "training.lr_warmup_iters=0", "training.global_batch_size=4", "cluster.tasks_per_node=2", layout,
                     name="moe", recipe="tiny-moe")
    trainer = Trainer(paths, world=2)
    assert trainer.wait() == [0, 0], trainer.log()[-3000:] + trainer.log(1)[-3000:]
    report = mcore_to_hf(paths.root, tmp_path / "hf", progress=False)
    cfg = config(tmp_path / "hf")
    assert (cfg["architectures"], cfg["num_local_experts"], cfg["intermediate_size"]) == (["MixtralForCausalLM"], 8, 64)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert report.tensors == len(weights) and sum(".experts." in n for n in weights) == 2 * 8 * 3
    vocab = cfg["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    model = dataclasses.asdict(load_recipe("tiny-moe").recipe.model)
    got = run_megatron_logits(1, str(paths.checkpoints / "iter_0000002"), model, vocab, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - expected).abs().max().item() <= MAX_ABS_DIFF
    generated = hf.generate(torch.tensor([[1, 17, 42]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9)


def test_training_at_ep2_starts_from_a_converted_mixtral(tmp_path: Path) -> None:
    """A Mixtral of tiny-moe's shape, converted with the recipe, is what the trainer loads at EP 2 (each rank its
    half of the experts) through --pretrained-checkpoint, trains on (lr ~ 0) and saves, and converts back to the
    same weights."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    recipe = load_recipe("tiny-moe").recipe
    torch.manual_seed(5)
    cfg = MixtralConfig(**{**TINY, "vocab_size": 512, "intermediate_size": 64, "num_local_experts": 8,
                           "num_experts_per_tok": 2, "max_position_embeddings": 64, "rope_theta": 10000.0,
                           "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "converted", model=recipe.model, vocab_size=512, progress=False)
    paths = make_run(tmp_path / "runs", "training.train_iters=2", "checkpoint.save_interval=2", "training.lr=1e-12",
                     "training.min_lr=1e-12", "training.lr_warmup_iters=0", "training.global_batch_size=4",
                     "cluster.tasks_per_node=2", "parallel.expert_model_parallel_size=2",
                     f"megatron_args.pretrained_checkpoint={tmp_path / 'converted'}", name="moe", recipe="tiny-moe")
    trainer = Trainer(paths, world=2)
    assert trainer.wait() == [0, 0], trainer.log()[-3000:] + trainer.log(1)[-3000:]
    assert str(tmp_path / "converted") in trainer.log()
    mcore_to_hf(paths.root, tmp_path / "back", progress=False)
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0, msg=name)


def _copy_hf(src: Path, dst: Path, *, drop: str | None = None, cfg: dict[str, Any] | None = None) -> Path:
    dst.mkdir(parents=True)
    weights = load_file(src / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != drop}, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config(src), **(cfg or {})}))
    return dst


def _refused(call: Any, out: Path) -> str:
    with pytest.raises(ConversionError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message
    assert not out.exists() or (not any(out.rglob("*.distcp")) and not any(out.rglob("*.safetensors")))
    return message


def test_a_model_that_would_convert_in_part_is_refused(models: dict[Any, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing expert tensor, more experts than config.json says, a recipe with another expert count or top-k,
    and (mcore-to-hf) a Hugging Face config without the checkpoint's shared expert, whether the checkpoint's
    arguments tell (the config does not describe it) or not (its shared expert has no place): one line each,
    nothing written."""
    mixtral = models[("mixtral", False, "float32")] / "hf"
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    missing = _copy_hf(mixtral, tmp_path / "missing", drop=name)
    message = _refused(lambda: hf_to_mcore(missing, tmp_path / "o1", progress=False), tmp_path / "o1")
    assert f"tensor '{name}' is missing" in message
    fewer = _copy_hf(mixtral, tmp_path / "fewer", cfg={"num_local_experts": 3})
    message = _refused(lambda: hf_to_mcore(fewer, tmp_path / "o2", progress=False), tmp_path / "o2")
    assert message.startswith("model.num_experts: ") and "holds 4 experts per layer" in message
    recipe = dataclasses.replace(model_from_hf_config(config(mixtral)).model, num_experts=8, moe_router_topk=1)
    message = _refused(lambda: hf_to_mcore(mixtral, tmp_path / "o3", model=recipe, progress=False), tmp_path / "o3")
    assert "model.num_experts: recipe 8, Hugging Face 4" in message and "model.moe_router_topk: recipe 1" in message
    qwen2 = models[("qwen2_moe", False, "float32")] / "mcore"
    message = _refused(lambda: mcore_to_hf(qwen2, tmp_path / "o4", hf_template=mixtral, progress=False),
                       tmp_path / "o4")
    assert "moe_shared_expert_intermediate_size: checkpoint 48, Hugging Face None" in message
    from megalaunch.conversion import to_hf
    from megalaunch.conversion.checkpoint_io import mcore_dist

    load = mcore_dist.load_common  # a checkpoint without arguments or a stored config
    monkeypatch.setattr(mcore_dist, "load_common", lambda p: {k: v for k, v in load(p).items()
                                                              if k not in ("args", to_hf.CONVERSION_KEY)})
    message = _refused(lambda: mcore_to_hf(qwen2, tmp_path / "o5", hf_template=mixtral, progress=False),
                       tmp_path / "o5")
    assert "has no place in the Hugging Face mixtral model" in message and "--family or --hf-template" in message
