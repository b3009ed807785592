"""megalaunch's grouped-GEMM experts (runtime/model/experts/) against Megatron's SequentialMLP in a tiny MoE GPTModel
on the CPU (fp32, gloo): one seed gives both the same weights; forward and gradients agree; the distributed
checkpoint is SequentialMLP's tensor for tensor (keys, offsets, shapes, replica ids), so a torch_dist checkpoint
saved with either class loads into the other, on one rank and with expert parallelism 2 on two ranks; and the
real trainer (recipe tiny-moe, EP 2 on two ranks, the distributed optimizer's expert buffers) trains the same
losses with either, as MEGALAUNCH_MOE_EXPERTS and the ledger say."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness import Trainer, ledger, losses, make_run
from tests.support import forkserver

pytestmark = [pytest.mark.megatron]

ROOT = Path(__file__).resolve().parents[2]

COMMON = r"""
import json, os, sys, torch
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import build_gpt_model
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.dict_utils import nested_values

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    seq_length=32, max_position_embeddings=32, make_vocab_size_divisible_by=64, normalization="RMSNorm",
                    swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)

def shards(model, with_data=True):
    out = []
    for v in nested_values(model.sharded_state_dict()):
        for t in (v.build() if isinstance(v, ShardedTensorFactory) else [v]):
            if ".experts." in t.key:
                data = t.data.tolist() if isinstance(t, ShardedTensor) and with_data else None
                out.append((type(t).__name__, t.key, tuple(t.global_offset), tuple(t.global_shape), str(t.replica_id),
                            tuple(getattr(t, "local_shape", ())), data))
    return sorted(out, key=str)

def experts(model):
    # each expert's fc1 and fc2 whichever class holds them: {layer.fc.expert: tensor}
    out, sd = {}, model.state_dict()
    for k, v in sd.items():
        if ".experts.weight" in k:
            for e in range(v.shape[0]):
                out[f"{k.split('.mlp.')[0]}.fc{k[-1]}.{e}"] = v[e]
        elif ".local_experts." in k and k.endswith(".weight"):
            layer, e, fc = k.split(".mlp.")[0], k.split(".local_experts.")[1].split(".")[0], k.split("linear_fc")[1][0]
            out[f"{layer}.fc{fc}.{e}"] = v
    return out

def zero(model):
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()

def roundtrip(src, dst, path):
    # torch_dist save of src, load into dst (zeroed first): True where every expert tensor came back
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(src.sharded_state_dict(), path)
    zero(dst)
    dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), path))
    a, b = experts(src), experts(dst)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
"""

ONE_RANK = COMMON + r"""
from megalaunch.runtime.model.standalone import megatron_parallel_state
with megatron_parallel_state(seed=7):
    a = build_gpt_model(MODEL, vocab_size=200, experts="sequential")
with megatron_parallel_state(seed=7):
    b = build_gpt_model(MODEL, vocab_size=200, experts="grouped")
    kinds = sorted({type(m).__name__ for m in b.modules()} - {type(m).__name__ for m in a.modules()})
    ea, eb = experts(a), experts(b)
    same_init = sorted(ea) == sorted(eb) and all(torch.equal(ea[k], eb[k]) for k in ea)
    same_shards = shards(a) == shards(b)
    torch.manual_seed(0)
    tokens, labels, pos = torch.randint(0, 200, (3, 32)), torch.randint(0, 200, (3, 32)), torch.arange(32).expand(3, 32)
    losses = []
    for m in (a, b):
        loss = torch.nn.functional.cross_entropy(m(tokens, pos, None).transpose(1, 2), labels)
        loss.backward()
        losses.append(loss.item())
    grads = {}
    for m, tag in ((a, "a"), (b, "b")):
        for k, p in m.named_parameters():
            if ".experts.weight" in k:
                for e in range(p.shape[0]):
                    grads.setdefault(f"{k.split('.mlp.')[0]}.fc{k[-1]}.{e}", {})[tag] = p.grad[e]
            elif ".local_experts." in k:
                layer, e, fc = k.split(".mlp.")[0], k.split(".local_experts.")[1].split(".")[0], k.split("linear_fc")[1][0]
                grads.setdefault(f"{layer}.fc{fc}.{e}", {})[tag] = p.grad
            else:
                grads.setdefault(k, {})[tag] = p.grad
    grad_rel = max((g["a"] - g["b"]).abs().max().item() / max(g["a"].abs().max().item(), 1e-30) for g in grads.values())
    marks = sorted({(p.allreduce, p.tensor_model_parallel, p.partition_dim) for k, p in b.named_parameters()
                    if ".experts.weight" in k})
    import tempfile
    d = tempfile.mkdtemp()
    seq_to_grouped = roundtrip(a, b, d + "/seq")
    grouped_to_seq = roundtrip(b, a, d + "/grouped")
print(json.dumps(dict(kinds=kinds, same_init=same_init, same_shards=same_shards, losses=losses, grad_rel=grad_rel,
                      grads=len(grads), marks=marks, seq_to_grouped=seq_to_grouped, grouped_to_seq=grouped_to_seq)))
"""

TWO_RANKS = COMMON + r"""
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megalaunch.runtime.model import cpu_compat
cpu_compat.enable()
rank, port, root, split = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2 if split == "ep" else 1,
                                         expert_tensor_parallel_size=2 if split == "etp" else 1)
torch.manual_seed(11)
model_parallel_cuda_manual_seed(11)
seq = build_gpt_model(MODEL, vocab_size=200, experts="sequential")
grouped = build_gpt_model(MODEL, vocab_size=200, experts="grouped")
local = [list(p.shape) for k, p in grouped.named_parameters() if k.endswith("experts.weight1")]
grouped.load_state_dict(seq.state_dict())  # SequentialMLP's per-expert keys, stacked
torch.manual_seed(0)
tokens, pos = torch.randint(0, 200, (2, 32)), torch.arange(32).expand(2, 32)
with torch.no_grad():
    ref, got = seq(tokens, pos, None), grouped(tokens, pos, None)
forward_rel = ((ref - got).abs().max() / ref.abs().max()).item()
same_shards = shards(seq, with_data=False) == shards(grouped, with_data=False)  # two seeds: the layout only
zero(grouped)  # both directions start from different weights
seq_to_grouped = roundtrip(seq, grouped, root + "/seq")
torch.manual_seed(12)
with torch.no_grad():
    for p in grouped.parameters():
        p.normal_()
grouped_to_seq = roundtrip(grouped, seq, root + "/grouped")
print(json.dumps(dict(rank=rank, local=local, forward_rel=forward_rel, same_shards=same_shards,
                      seq_to_grouped=seq_to_grouped, grouped_to_seq=grouped_to_seq)))
dist.destroy_process_group()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def _result(p: subprocess.CompletedProcess[str]) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_grouped_experts_match_sequential_mlp() -> None:
    """The same seed builds the same expert weights; loss equal to 1e-6 relative, every gradient to 1e-5 of its
    largest; the sharded tensors are SequentialMLP's; torch_dist checkpoints load across the two classes."""
    r = _result(subprocess.run([forkserver.python(), "-c", ONE_RANK], capture_output=True, text=True, env=_env(),
                               timeout=300))
    assert r["kinds"] == ["GroupedExperts"], r
    assert r["same_init"] and r["same_shards"], r
    assert abs(r["losses"][0] - r["losses"][1]) <= 1e-6 * abs(r["losses"][0]), r
    assert r["grad_rel"] <= 1e-5 and r["grads"] > 2 * 2 * 8, r
    assert r["marks"] == [[True, True, 1], [True, True, 2]], r  # EP 1: reduced with the dense parameters
    assert r["seq_to_grouped"] and r["grouped_to_seq"], r


@pytest.mark.parametrize(("split", "local"), [("ep", [4, 64, 64]), ("etp", [8, 32, 64])])
def test_checkpoints_cross_between_the_classes_with_expert_parallelism(tmp_path: Path, split: str, local: list[int]) -> None:
    """Two gloo ranks, EP 2 (4 of the 8 experts each) or expert TP 2 (each expert's fc1 split by rows, fc2 by
    columns; the dispatcher reduces the partial sums): SequentialMLP's weights give the same logits, the sharded
    tensors are SequentialMLP's on each rank (the expert axis at the rank's offset, the TP axis at its slice), and
    torch_dist checkpoints load across the classes."""
    from megalaunch.runtime.rank.dist_env import free_port

    port = str(free_port())
    procs = [subprocess.Popen([forkserver.python(), "-c", TWO_RANKS, str(rank), port, str(tmp_path), split],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for rank in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    results = [_result(subprocess.CompletedProcess(p.args, p.returncode, *out)) for p, out in zip(procs, outs, strict=True)]
    for r in results:
        assert r["local"] == [local, local], r  # [local experts, fc1 rows (gate + up), hidden] in both layers
        assert r["forward_rel"] <= 1e-5, r
        assert r["same_shards"] and r["seq_to_grouped"] and r["grouped_to_seq"], r


def test_the_trainer_trains_the_same_losses_with_either_class(tmp_path: Path) -> None:
    """tiny-moe, EP 2 on two gloo ranks, 4 iterations: every loss within 1e-5 relative (CPU fp32; the expert
    gradients reduced over the expert data-parallel group, the optimizer's expert buffers), and the ledger's kernels
    record names the experts that ran."""
    sets = ("training.train_iters=4", "training.global_batch_size=4", "training.lr_warmup_iters=1",
            "checkpoint.save_interval=100", "cluster.tasks_per_node=2", "parallel.expert_model_parallel_size=2")
    got = {}
    for experts in ("sequential", "grouped"):
        paths = make_run(tmp_path / experts, *sets, name=f"moe-{experts}", recipe="tiny-moe")
        log = tmp_path / f"{experts}.jsonl"
        t = Trainer(paths, world=2, job_id="7", env={"MEGALAUNCH_LOSS_LOG": str(log), "MEGALAUNCH_MOE_EXPERTS": experts})
        assert t.wait() == [0, 0], t.log()[-3000:] + t.log(1)[-3000:]
        record = ledger(paths, "kernels")[-1]
        assert record["experts"] == experts and "MEGALAUNCH_MOE_EXPERTS" in record["experts_why"], record
        got[experts] = losses(log)
    assert sorted(got["sequential"]) == sorted(got["grouped"]) == [1, 2, 3, 4], got
    for i, ref in got["sequential"].items():
        assert abs(got["grouped"][i] - ref) <= 1e-5 * abs(ref), got
