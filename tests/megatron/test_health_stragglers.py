"""The health check and the straggler summary in the real trainer (Megatron on the CPU, 2 ranks over
gloo): a rank made slow in the check ends the segment `unhealthy_node` before the model is built;
a healthy check records its figure, and a rank made slow in its forward steps is named as the
straggler at the segment's end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import Trainer, ledger, make_run

pytestmark = pytest.mark.megatron

TWO_RANKS = ("cluster.tasks_per_node=2", "training.micro_batch_size=1", "training.global_batch_size=2",
             "cluster.health_check=on", "cluster.health_check_margin=0.5")


def test_a_slow_rank_ends_the_segment_unhealthy_before_the_model_is_built(tmp_path: Path) -> None:
    paths = make_run(tmp_path, *TWO_RANKS, "training.train_iters=50")
    # an earlier segment's list of what Megatron imported after the check: imported during this one's
    paths.state.mkdir(parents=True, exist_ok=True)
    (paths.state / "startup-modules.json").write_text(json.dumps({"modules": [
        "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.no_such_module", "json"]}))
    t = Trainer(paths, world=2, job_id="61", env={"MEGALAUNCH_TEST_SLOW_NODE": "rank1:10"})
    assert t.wait(240) == [0, 0], t.log(0)[-3000:] + t.log(1)[-3000:]
    out = t.outcome()
    assert out["status"] == "unhealthy_node", out
    check = out["health_check"]
    assert not check["healthy"] and "rank 1" in out["reason"] and "below the job's median" in out["reason"]
    r0, r1 = check["ranks"]
    assert r1["tflops"] < 0.2 * r0["tflops"] and r0["allreduce_gbps"] > 0 and check["seconds"] < 30
    for rank in (0, 1):  # both ranks took the decision and logged their own figures
        assert "health check on" in t.log(rank) and "outcome unhealthy_node" in t.log(rank)
    timeline = json.loads(paths.timeline("61").read_text())
    assert {"health_check_start", "health_check_end"} <= set(timeline["phases"])
    assert "model_build_start" not in timeline["phases"]  # Megatron built nothing
    warm = timeline["warm_imports"]
    assert warm["failed"] == 1 and warm["imported"] + warm["failed"] <= warm["modules"] <= 2, warm
    assert [e["unhealthy_nodes"] for e in ledger(paths, "health_check")] == [check["unhealthy_nodes"]]
    assert paths.read_tracker() is None


def test_a_healthy_check_records_its_figure_and_a_slow_forward_rank_is_the_straggler(tmp_path: Path) -> None:
    paths = make_run(tmp_path, *TWO_RANKS, "training.train_iters=12", "training.lr_warmup_iters=2",
                     "checkpoint.save_interval=6")
    t = Trainer(paths, world=2, job_id="62", env={"MEGALAUNCH_TEST_SLOW_FORWARD": "1:0.3"})
    assert t.wait(300) == [0, 0], t.log(0)[-3000:]
    out = t.outcome()
    assert out["status"] == "finished" and out["health_check"]["healthy"], out
    (end,) = [e for e in ledger(paths, "stragglers") if e["at"] == "end"]
    assert [e["at"] for e in ledger(paths, "stragglers")] == ["save", "save", "end"]  # saves at 6 and 12
    # rank 1 sleeps 0.3 s in each forward step: its mean step that much longer than rank 0's, whatever the load
    # (a spread over a fixed figure failed on a busy CI machine, where every step is slower: 0.487)
    assert end["slowest"]["rank"] == 1 and end["straggling"], end
    assert end["slowest"]["mean_s"] - end["fastest"]["mean_s"] > 0.25, end
    assert out["stragglers"]["slowest"]["rank"] == 1
    # what Megatron imported after the health check, recorded for the next segment's (warm_imports.py)
    modules = json.loads((paths.state / "startup-modules.json").read_text())["modules"]
    assert any(m.startswith("megatron.") for m in modules) and all(m.split(".")[0] in ("torch", "megatron")
                                                                  for m in modules), modules
    baselines = Path(json.loads(paths.runtime_json.read_text())["node_health_dir"]) / "health_baselines.jsonl"
    (rec,) = [json.loads(x) for x in baselines.read_text().splitlines()]
    assert rec["device"].startswith("cpu fp32") and rec["tflops"] > 0 and rec["job_id"] == "62"
