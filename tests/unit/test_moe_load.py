"""An MoE run's expert load as its readers see it (runtime/observation/moe_balance.py), from synthetic
state/moe_load.jsonl files: the collapse rule for any top-k and number of experts, the lines `status`
prints (and none for a dense run), the file's tail and sample, and the report's figure (for an MoE run
only: a copy of the report chain with a load file added)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.unit.report_chain import REPORT_CHAIN_GROUP
from tests.unit.test_report import FIGURES, assert_png, parse

from megalaunch.launcher import status
from megalaunch.launcher.status_format import moe_lines
from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.observation import moe_balance
from megalaunch.runtime.observation.moe_balance import (
    capture,
    collapsing,
    sampled,
    summary,
    tail,
    wandb_figures,
)


def record(iteration: int, layers: list[list[int]], *, topk: int = 2, dropped: int = 0,
           aux: float = 1.01) -> dict[str, object]:
    """A record as the job writes it: each layer's counts add up to tokens x topk."""
    rows = []
    for i, counts in enumerate(layers):
        mean = sum(counts) / len(counts)
        rows.append({"layer": i + 1, "tokens": sum(counts) // topk, "counts": counts, "dropped": dropped,
                     "max_over_mean": max(counts) / mean, "aux": {"load_balancing_loss": aux}})
    return {"iteration": iteration, "job_id": "7", "time": 0.0, "experts": len(layers[0]), "topk": topk,
            "steps": 5, "layers": rows, "aux": {"load_balancing_loss": aux}}


EVEN = [40, 40, 40, 40, 40, 40, 40, 40]  # 160 tokens, top-2 of 8: 25 % each
# top-2 of 8: 160 tokens, expert 5 takes 120 (75 %, capture (0.75 - 0.25) / 0.75 = 0.67 >= 0.5)
HOT = [29, 29, 29, 29, 28, 120, 28, 28]
# expert 5 at 96 of 160 tokens: 60 %, capture 0.47: busy, not collapsing
WARM = [32, 32, 32, 32, 32, 96, 32, 32]


def test_capture_is_the_way_from_the_even_share_to_every_token() -> None:
    assert capture(0.25, 2, 8) == 0.0 and capture(1.0, 2, 8) == 1.0
    assert capture(1.0, 1, 8) == 1.0 and capture(0.5625, 1, 8) == pytest.approx(0.5)  # top-1: 56 % is halfway
    assert capture(0.75, 1, 2) == pytest.approx(0.5)  # top-1 of 2 experts: 50 % is even, 75 % halfway
    assert capture(1.0, 8, 8) is None  # every expert takes every token: nothing to collapse


def test_a_router_collapses_after_three_intervals_of_one_expert() -> None:
    two = [record(5, [EVEN, HOT]), record(10, [EVEN, HOT])]
    assert collapsing(two) == []  # two intervals: not yet
    three = [*two, record(15, [EVEN, HOT])]
    (found,) = collapsing(three)
    assert found == {"layer": 2, "expert": 5, "share": 0.75, "even": 0.25, "intervals": 3, "since": 5}
    # an even interval in between breaks the run; a busy but not collapsed expert never counts
    assert collapsing([record(5, [EVEN, HOT]), record(10, [EVEN, EVEN]), *three[1:]]) == []
    assert collapsing([record(i, [WARM, WARM]) for i in (5, 10, 15, 20)]) == []
    # another expert taking over is not the same collapse
    moved = [25, 25, 25, 25, 25, 25, 145, 25]
    assert collapsing([*two, record(15, [EVEN, moved])]) == []
    # top-1 of 8: 90 of 160 tokens (56 %) on one expert is the threshold
    top1 = [10, 10, 10, 10, 10, 90, 10, 10]
    assert collapsing([record(i, [top1], topk=1) for i in (1, 2, 3)])[0]["share"] == pytest.approx(0.5625)


def test_summary_and_wandb_figures_name_the_worst_layer() -> None:
    s = summary(record(20, [EVEN, WARM], dropped=16))
    assert (s["worst_layer"], s["hot_expert"], s["hot_share"], s["even_share"]) == (2, 5, 0.6, 0.25)
    assert s["max_over_mean"] == pytest.approx(2.4) and s["dropped_share"] == pytest.approx(32 / 640)
    w = wandb_figures(record(20, [EVEN, WARM]))
    assert w["moe/layer_1/max_over_mean"] == 1.0 and w["moe/worst_max_over_mean"] == pytest.approx(2.4)
    assert w["moe/load_balancing_loss"] == 1.01


def test_status_names_the_worst_layer_and_a_collapsing_router(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.state.mkdir()
    assert status._moe(paths) is None and moe_lines(None) == []  # a dense run: nothing new
    for i, layers in enumerate([[EVEN, EVEN], [EVEN, HOT], [EVEN, HOT], [EVEN, HOT]]):
        append_jsonl(paths.moe_load, record(10 * (i + 1), layers, aux=1.2 - 0.05 * i))
    lines = moe_lines(status._moe(paths))
    assert lines[0] == ("  experts (iteration 40): worst layer 2, max/mean 3.00 (expert 5 took 75.0% of the tokens, "
                        "even 25.0%)   load_balancing_loss 1.05")
    assert lines[1].startswith("  router collapsing: layer 2: expert 5 took 75% of the tokens (even 25.0%) for 3 log "
                               "intervals, since iteration 20")
    assert len(lines) == 2
    append_jsonl(paths.moe_load, record(50, [EVEN, EVEN], dropped=8))
    lines = moe_lines(status._moe(paths))
    assert lines == ["  experts (iteration 50): worst layer 1, max/mean 1.00 (expert 0 took 25.0% of the tokens, "
                     "even 25.0%)   load_balancing_loss 1.01   dropped 2.5% of routed tokens"]


def test_tail_and_sample_read_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "moe_load.jsonl"
    for it in range(1, 1001):
        append_jsonl(path, record(it, [EVEN, EVEN]))
    with open(path, "a") as f:
        f.write('{"iteration": 1001, "layers": [')  # a record being written
    assert [r["iteration"] for r in tail(path, 3)] == [998, 999, 1000]
    picked = [r["iteration"] for r in sampled(path, 50)]
    assert len(picked) == 50 and picked[0] == 1 and picked[-1] == 1000 and picked == sorted(picked)
    assert tail(tmp_path / "none", 3) == [] and sampled(tmp_path / "none") == []


@REPORT_CHAIN_GROUP
def test_report_draws_the_expert_load_for_an_moe_run_only(report_chain: RunPaths, tmp_path: Path) -> None:
    from megalaunch.launcher.report.write import write_report

    dense = write_report(report_chain, tmp_path / "dense")
    assert "moe_load.png" not in [p.name for p in dense.figures] and 'id="experts"' not in dense.html.read_text()
    copy = RunPaths(Path(shutil.copytree(report_chain.root, tmp_path / "run", symlinks=True)))
    for it in range(5, 30, 5):
        append_jsonl(copy.moe_load, record(it, [EVEN, HOT if it > 10 else EVEN, WARM]))
    out = write_report(copy, tmp_path / "moe")
    assert sorted(p.name for p in out.figures) == sorted([*FIGURES, "moe_load.png"])
    assert_png(tmp_path / "moe" / "moe_load.png")
    html = out.html.read_text()
    assert sorted(parse(out.html).imgs) == sorted([*FIGURES, "moe_load.png"])
    assert '<li class="moe-collapse">layer 2: expert 5 took 75% of the tokens (even 25.0%) since iteration 15' in html
    assert f"in {moe_balance.COLLAPSE_INTERVALS} log intervals in a row" in html
