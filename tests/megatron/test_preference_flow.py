"""A user-defined training flow under the chain (issue 26): the preference-loss example
(runtime/flows/preference_flow.py, named in the recipe as `training.flow`) trains on pairs written by
`megalaunch data sft`, from a converted Hugging Face model, across two segments stopped by SIGUSR2;
its losses equal an uninterrupted run's at every iteration (exact resume), its metrics are reported,
the loss falls, and a flow that cannot be imported is a configuration error that ends the chain. With
tensor parallelism 2 the flow sees the same batches (its losses equal TP 1's)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from harness import FAST, Trainer, ledger, losses, run_segment
from tests.support.chat import make_chat_model, preference_rows, write_jsonl

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.tokenization.chat.build import build

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 16
FLOW = "megalaunch.runtime.flows.preference_flow:PreferenceFlow"


@pytest.fixture(scope="module")
def prep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A converted chat model and preference pairs written by `data sft` (made once for the module)."""
    root = tmp_path_factory.mktemp("prefs")
    hf = make_chat_model(root / "hf")
    write_jsonl(root / "pairs" / "train.jsonl", preference_rows(64))
    stats = build([str(root / "pairs")], root / "data", tokenizer=hf, seq_length=64)
    assert stats[0].pairs == 64
    hf_to_mcore(hf, root / "converted", model=load_recipe("sft-tiny").recipe.model, vocab_size=512, progress=False)
    return {"hf": hf, "data": root / "data", "converted": root / "converted"}


def _run(root: Path, prep: dict[str, Path], name: str, flow: str = FLOW, *more: str):
    sets = [*FAST, "training.global_batch_size=4", "training.micro_batch_size=2", f"training.train_iters={ITERS}",
            "checkpoint.save_interval=4", "checkpoint.keep_last=20", "data.mock=false",
            f"data.blend=[{{path: {prep['data']}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prep['hf']}", f"checkpoint.load={prep['converted']}", f"training.flow={flow}", *more]
    return write_run(prepare_run(load_recipe("sft-tiny", sets, name=name), root=root))


def test_preference_flow_resumes_exactly_under_the_chain(prep: dict[str, Path], tmp_path: Path) -> None:
    straight = _run(tmp_path / "a", prep, "straight")
    ref_log = tmp_path / "straight.jsonl"
    t = run_segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"
    assert "preference accuracy" in t.log() and "reward margin" in t.log()  # the flow's metrics, reported

    chain = _run(tmp_path / "b", prep, "chain")
    log = tmp_path / "chain.jsonl"
    first = run_segment(chain, "201", log, 5).outcome()
    assert first["status"] == "saved", first
    assert run_segment(chain, "202", log, None).outcome()["status"] == "finished"
    assert [r["consumed_samples"] for r in ledger(chain, "resumed")] == [4 * first["iteration"]]  # pairs

    ref, got = losses(ref_log), losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}
    assert sum(ref[i] for i in range(ITERS - 3, ITERS + 1)) < sum(ref[i] for i in range(1, 5))  # it learns

    broken = _run(tmp_path / "c", prep, "broken", flow="nowhere.flows:Missing")
    t = Trainer(broken, job_id="300")
    assert t.wait() == [1]
    out = t.outcome()
    assert out["status"] == "config_error" and "nowhere.flows:Missing" in out["reason"], out


def test_tensor_parallel_flow_gets_the_same_batches(prep: dict[str, Path], tmp_path: Path) -> None:
    """TP = 2: rank 0 reads each micro-batch and megalaunch broadcasts it to the other TP rank; the losses
    equal TP = 1's (to float rounding of the split matmuls)."""
    got = {}
    for tp in (1, 2):
        paths = _run(tmp_path / f"tp{tp}", prep, f"tp{tp}", FLOW, "training.train_iters=4",
                     f"parallel.tensor_model_parallel_size={tp}", f"cluster.tasks_per_node={tp}")
        log = tmp_path / f"tp{tp}.jsonl"
        t = Trainer(paths, world=tp, env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait() == [0] * tp, t.log()[-3000:]
        got[tp] = losses(log)
    assert sorted(got[1]) == sorted(got[2]) == [1, 2, 3, 4]
    assert all(math.isclose(got[1][i], got[2][i], rel_tol=1e-5) for i in got[1]), got
