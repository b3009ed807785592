"""Bad mixture-of-experts settings are refused by `megalaunch submit --dry-run` before anything is written:
one line naming the field, a non-zero exit, no traceback, no run directory (config/model/moe.py's
`check_moe` and config/topology.py, run by preflight). The same recipe with good settings passes, so each
refusal is the setting's, not the recipe's."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.helpers import cli

EP2 = ["cluster.tasks_per_node=2", "parallel.expert_model_parallel_size=2", "training.global_batch_size=4"]
TP2 = ["cluster.tasks_per_node=2", "parallel.tensor_model_parallel_size=2", "training.global_batch_size=2"]

# (id, --set values on the tiny-moe recipe (tiny-moe: 8 experts of ffn 64, top-2), the field the line must name)
CASES: list[tuple[str, list[str], str]] = [
    ("one expert", ["model.num_experts=1", "model.moe_router_topk=1"], "model.num_experts"),
    ("top-k above the experts", ["model.moe_router_topk=9"], "model.moe_router_topk"),
    ("EP not dividing the experts", ["cluster.tasks_per_node=3", "parallel.expert_model_parallel_size=3",
                                     "training.global_batch_size=3"], "parallel.expert_model_parallel_size"),
    ("TP 2 without sequence parallelism", TP2, "parallel.sequence_parallel"),
    ("drop policy without a capacity factor", ["model.moe_token_drop_policy=position"],
     "model.moe_token_drop_policy"),
    ("padding without a capacity factor", ["model.moe_pad_expert_input_to_capacity=true"],
     "model.moe_pad_expert_input_to_capacity"),
    ("MoE field on a dense model", ["model.num_experts=null", "model.moe_ffn_hidden_size=null",
                                    "model.moe_aux_loss_coeff=1e-3", "model.moe_router_topk=4"],
     "model.moe_router_topk"),
    ("expert bias with softmax scores", ["model.moe_router_enable_expert_bias=true"],
     "model.moe_router_enable_expert_bias"),
    ("group-limited routing half set", ["model.moe_router_num_groups=4"], "model.moe_router_group_topk"),
    ("expert TP on a dense model", ["model.num_experts=null", "model.moe_ffn_hidden_size=null",
                                    "model.moe_aux_loss_coeff=1e-3", "cluster.tasks_per_node=2",
                                    "parallel.expert_tensor_parallel_size=2", "training.global_batch_size=2"],
     "parallel.expert_tensor_parallel_size"),
    ("capacity factor not positive", ["model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor"),
]


def _submit(tmp_path: Path, sets: list[str]):
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(f"include: [tiny-moe]\nname: moe\nrun: {{root: {tmp_path / 'runs'}}}\n")
    return cli("submit", str(recipe), "--dry-run", *[a for s in sets for a in ("--set", s)])


@pytest.mark.parametrize(("case_id", "sets", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_moe_setting_is_refused_in_one_line(case_id: str, sets: list[str], field: str, tmp_path: Path) -> None:
    proc = _submit(tmp_path, sets)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error:"), proc.stderr
    assert field in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout.strip() == ""
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sets", [[], EP2, [*TP2, "parallel.sequence_parallel=true"],
                                  ["model.moe_expert_capacity_factor=1.25", "model.moe_token_drop_policy=position"],
                                  ["model.moe_router_num_groups=4", "model.moe_router_group_topk=2"]],
                         ids=["defaults", "EP 2", "TP 2 with SP", "capacity", "group-limited routing"])
def test_good_moe_settings_pass_the_dry_run(sets: list[str], tmp_path: Path) -> None:
    proc = _submit(tmp_path, sets)
    assert proc.returncode == 0, proc.stderr
    assert "--num-experts 8" in proc.stdout and "nothing written" in proc.stdout
    assert not (tmp_path / "runs").exists()
