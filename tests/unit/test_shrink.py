"""Shrinking (cluster.min_nodes, issue 33): which node counts a layout allows (config/topology.node_counts),
the checks at submit, the job script, and what `job step-end` / `job step-nodes` decide when a
node is lost with no spare left (launcher/chain/restart.py), against a real run directory. The Slurm
side with the real CPU trainer: tests/slurm/test_shrink_slurm.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.unit.test_restart import _chain as restart_chain

from megalaunch.config.loader import load_recipe
from megalaunch.config.preflight import preflight
from megalaunch.config.topology import node_counts
from megalaunch.errors import ConfigError, PreflightError
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.chain.restart import step_end, step_nodes
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import write_outcome

SLURM = ["cluster.backend=slurm", "cluster.tasks_per_node=1"]


def _recipe(tmp_path: Path, *sets: str):
    return load_recipe("tiny", [f"run.root={tmp_path}", *SLURM, *sets]).recipe


@pytest.mark.parametrize(("sets", "counts"), [
    (["cluster.nodes=4", "cluster.min_nodes=2", "training.global_batch_size=12"], [4, 3, 2]),
    (["cluster.nodes=4", "cluster.min_nodes=1", "training.global_batch_size=8"], [4, 2, 1]),  # DP 3 does not divide 8
    (["cluster.nodes=6", "cluster.min_nodes=2", "training.global_batch_size=24", "cluster.tasks_per_node=2",
      "parallel.tensor_model_parallel_size=2"], [6, 4, 3, 2]),  # DP = nodes: 5 does not divide 24
    (["cluster.nodes=4", "training.global_batch_size=12"], [4]),  # no min_nodes: never smaller
])
def test_node_counts_are_those_whose_data_parallel_size_the_layout_allows(
        tmp_path: Path, sets: list[str], counts: list[int]) -> None:
    assert node_counts(_recipe(tmp_path, *sets)) == counts


def test_min_nodes_is_checked(tmp_path: Path) -> None:
    for value in ("0", "4", "5"):
        with pytest.raises(ConfigError, match=r"cluster.min_nodes must be from 1 to cluster.nodes - 1 = 3"):
            load_recipe("tiny", [f"run.root={tmp_path}", *SLURM, "cluster.nodes=4", f"cluster.min_nodes={value}"])
    with pytest.raises(ConfigError, match="min_nodes needs backend: slurm"):
        load_recipe("tiny", [f"run.root={tmp_path}", "cluster.backend=local", "cluster.nodes=2", "cluster.min_nodes=1"])
    # 8 sequences on 4 nodes, min 3: DP 3 does not divide 8, so nothing to shrink to
    with pytest.raises(PreflightError, match=r"cluster.min_nodes: no node count from 3 to 3 .* \| fix: lower"):
        preflight(_recipe(tmp_path, "cluster.nodes=4", "cluster.min_nodes=3", "training.global_batch_size=8"))


def test_the_job_survives_a_node_failure_and_asks_for_all_its_nodes(tmp_path: Path) -> None:
    """No node range (--nodes=2-4): Slurm 22.05's cons_tres gave such a job its minimum, 2 of 36 idle nodes."""
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", *SLURM, "cluster.nodes=4", "cluster.min_nodes=2",
                                  "training.global_batch_size=12"])
    script = write_run(prepare_run(loaded)).job_script.read_text()
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --no-kill\n" in script
    assert 'srun --kill-on-bad-exit=1 "${step_args[@]}" --nodes="$step_count"' in script


def _chain(tmp_path: Path, *sets: str) -> tuple[RunPaths, Chain]:
    """test_restart's run (later --set values win): 4 nodes, a global batch of 12, room for restarts."""
    return restart_chain(tmp_path, "cluster.tasks_per_node=1", "cluster.nodes=4", "training.global_batch_size=12",
                         "chain.restarts_per_segment=3", "chain.max_segments_without_progress=5", *sets)


@pytest.fixture()
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-4]")
    monkeypatch.setenv("MEGALAUNCH_DEADLINE", str(time.time() + 3600))
    return monkeypatch


def _lose(paths: RunPaths, node: str, step: int = 0) -> None:
    """Step `step` lost `node`: Slurm's node-failure line in the segment log (after the restart marker of
    the step), a survivor's failed collective."""
    write_outcome(paths, "failed", reason="gloo: connection closed by peer")
    paths.tasks("7").mkdir(parents=True, exist_ok=True)
    (paths.tasks("7") / "rank-00000.json").write_text('{"rank": 0, "exit_code": 1, "node": "node1", "ended": 5}')
    paths.segment_log("7").parent.mkdir(parents=True, exist_ok=True)
    marker = f"megalaunch: in-job restart: step {step}\n" if step else ""
    paths.segment_log("7").write_text(f"{marker}srun: error: Node failure on {node}\n")


def test_a_lost_node_with_min_nodes_shrinks_the_step_and_a_second_loss_shrinks_it_further(
        tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path, "cluster.min_nodes=2")
    chain.begin("7")
    assert step_nodes(chain, "7", 0) == ["node1", "node2", "node3", "node4"]
    _lose(paths, "node3")
    end = step_end(chain, "7", 0, 1)
    assert end.restart, end
    restart = [e for e in chain.ledger.events() if e["event"] == "restart"][-1]
    assert restart["exclude"] == ["node3"] and restart["shrink_to"] == 3, restart
    assert step_nodes(chain, "7", 1) == ["node1", "node2", "node4"]
    started = [e for e in chain.ledger.events() if e["event"] == "step_started"][-1]
    assert started["node_count"] == 3 and started["shrunk_from"] == 4, started
    text = format_run_status(run_status(paths))
    assert "kept off node3; went on with 3 nodes (no spare left, cluster.min_nodes)" in text, text
    # a second node lost: 2 left, still >= min_nodes
    _lose(paths, "node4", step=1)
    assert step_end(chain, "7", 1, 1).restart
    assert step_nodes(chain, "7", 2) == ["node1", "node2"]
    # a third: 1 left, below min_nodes 2: the segment ends, the successor asks for replacements
    _lose(paths, "node2", step=2)
    end = step_end(chain, "7", 2, 1)
    assert not end.restart and "node2 (lost)" in end.reason and "below cluster.min_nodes" in end.reason, end


def test_a_lost_node_without_min_nodes_or_a_spare_ends_the_segment(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path)
    env.setenv("SLURM_JOB_NODELIST", "node[1-4]")
    chain.begin("7")
    step_nodes(chain, "7", 0)
    _lose(paths, "node2")
    end = step_end(chain, "7", 0, 1)
    assert not end.restart and "replace node2 (lost)" in end.reason and "cluster.min_nodes would go on" in end.reason
    # with a spare the same loss restarts on the spare, at full size
    env.setenv("SLURM_JOB_NODELIST", "node[1-5]")
    assert step_end(chain, "7", 0, 1).restart
    assert step_nodes(chain, "7", 1) == ["node1", "node3", "node4", "node5"]


def test_a_rank_failure_with_min_nodes_keeps_the_node_rather_than_shrink(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path, "cluster.min_nodes=2")
    chain.begin("7")
    step_nodes(chain, "7", 0)
    write_outcome(paths, "failed", reason="test: a rank crashed")
    paths.tasks("7").mkdir(parents=True)
    (paths.tasks("7") / "rank-00002.json").write_text('{"rank": 2, "signal": "SIGSEGV", "node": "node3", "ended": 5}')
    assert step_end(chain, "7", 0, 139).restart
    restart = [e for e in chain.ledger.events() if e["event"] == "restart"][-1]
    assert restart["exclude"] == [] and "node3" in restart["kept"] and "shrink_to" not in restart, restart
    assert len(step_nodes(chain, "7", 1)) == 4


def test_with_three_nodes_usable_the_step_runs_the_largest_count_the_layout_allows(
        tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path, "cluster.min_nodes=1", "training.global_batch_size=8")
    env.setenv("SLURM_JOB_NODELIST", "node[1-3]")  # 3 left usable (a node lost): DP 3 does not divide 8, so 2
    chain.begin("7")
    assert step_nodes(chain, "7", 0) == ["node1", "node2"]
