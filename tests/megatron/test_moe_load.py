"""The expert load of a real MoE run (runtime/observation/moe_load.py): the tiny-moe recipe (8 experts, top-2, 2
layers) on one CPU rank for 20 iterations, logging every 5, with a capacity factor of 1.0 so that tokens are
dropped. Every log interval gives one record whose per-layer counts add up to the interval's tokens x top-k,
with dropped tokens, and the aux loss Megatron logged for that interval; progress.json carries its headline
and `status` prints it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from harness import Trainer, make_run

from megalaunch.launcher import status
from megalaunch.launcher.status_format import moe_lines
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.runtime.observation.moe_balance import summary

pytestmark = [pytest.mark.megatron]

ITERS, LOG_EVERY = 20, 5
TOKENS = 2 * 64 * LOG_EVERY  # global batch 2 x 64 tokens, per iteration of an interval


@pytest.mark.timeout(240)
def test_moe_load_per_log_interval(tmp_path: Path) -> None:
    paths = make_run(tmp_path, f"training.train_iters={ITERS}", f"training.log_interval={LOG_EVERY}",
                     "checkpoint.save_interval=1000", "model.moe_expert_capacity_factor=1.0",
                     name="moe", recipe="tiny-moe")
    t = Trainer(paths)
    assert t.wait(timeout=200) == [0], t.log()[-3000:]
    assert t.outcome()["status"] == "finished", t.log()[-3000:]
    records = read_jsonl(paths.moe_load)
    assert [r["iteration"] for r in records] == [5, 10, 15, 20], records
    # what Megatron printed for each interval: its load-balancing loss (averaged over the interval's iterations)
    logged = {int(it): float(v) for it, v in
              re.findall(r"iteration +(\d+)/ *\d+ \|.*?load_balancing_loss: ([0-9.E+-]+)", t.log())}
    for r in records:
        assert (r["experts"], r["topk"], r["steps"], [la["layer"] for la in r["layers"]]) == (8, 2, 5, [1, 2])
        for la in r["layers"]:
            assert la["tokens"] == TOKENS and sum(la["counts"]) == TOKENS * 2, la
            assert min(la["counts"]) >= 0 and 0 < la["dropped"] < TOKENS * 2, la
            assert 1.0 <= la["max_over_mean"] <= 4.0 and math.isfinite(la["max_over_mean"])
            assert la["max_over_mean"] == pytest.approx(max(la["counts"]) / (TOKENS * 2 / 8), abs=1e-3)
            assert la["aux"]["load_balancing_loss"] > 0
        assert r["aux"]["load_balancing_loss"] == pytest.approx(logged[r["iteration"]], rel=1e-5)
    progress = read_json(paths.progress)
    assert progress["iteration"] == ITERS and progress["moe"] == summary(records[-1])
    line = moe_lines(status._moe(paths))[0]
    assert line.startswith("  experts (iteration 20): worst layer ") and "dropped" in line, line
