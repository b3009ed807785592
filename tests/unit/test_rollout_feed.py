"""GRPO's rollout feed without Megatron (runtime/flows/rollout_feed.py, rollout_data.py): rank 0 brings rounds in
as iterations reach them and records which iterations each serves; a missing round stops with the reason after
rollout_wait_s and the other ranks read the same verdict from rank 0's state file; a round that is not a multiple
of the global batch is refused before its marker (so no rank can take it for usable); the dataset's old
log-probabilities are the labels' (row t = log p_old(token t + 1 | <= t))."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from megalaunch.runtime.flows.rollout_feed import FeedConfig, RolloutFeed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.chat import make_chat_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_chat_tokenizer(out)
    return out


def _round(directory: Path, k: int, groups: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"red cat {k} {g}", "completions": ["cat red", "dog"], "rewards": [1.0, 0.0]}
            for g in range(groups)]
    path = directory / f"round-{k:06d}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _feed(tmp_path: Path, tokenizer: Path, *, is_zero: bool, wait_s: float = 0.05) -> RolloutFeed:
    config = FeedConfig(source=tmp_path / "rounds", run_dir=tmp_path / "run", tokenizer=tokenizer, global_batch=2,
                        train_iters=10, wait_s=wait_s, job_id="7")
    return RolloutFeed(config, is_zero=is_zero, log=lambda _line: None)


def test_rounds_come_in_order_and_a_missing_one_stops_every_rank_with_the_reason(tmp_path: Path,
                                                                                   tokenizer: Path) -> None:
    _round(tmp_path / "rounds", 1, 2)  # 4 completions = iterations 1-2
    _round(tmp_path / "rounds", 2, 1)  # 2 completions = iteration 3
    zero = _feed(tmp_path, tokenizer, is_zero=True)
    assert zero.ready(1) is None and zero.ready(2) is None and zero.ready(3) is None
    assert zero.locate(5) == (1, 1) and zero.locate(6) is None
    record = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "record.jsonl").read_text().splitlines()]
    assert [(r["round"], r["first_iteration"], r["last_iteration"], r["completions"]) for r in record] == \
        [(1, 1, 2, 4), (2, 3, 3, 2)]
    reason = zero.ready(4)
    assert reason is not None and "rollout round 3" in reason and "rollout_wait_s=0.05 s" in reason
    other = _feed(tmp_path, tokenizer, is_zero=False, wait_s=1e9)  # waits on rank 0's state, not on a clock
    assert other.ready(2) is None and other.ready(4) == reason
    assert zero.ready(11) is None  # past train_iters: nothing to bring


def test_a_round_that_is_not_whole_iterations_is_refused_before_its_marker(tmp_path: Path, tokenizer: Path) -> None:
    # the first round (each round costs a tokenizing process, ~3.7 CPU-s: no good round before it)
    (tmp_path / "rounds").mkdir()
    bad = tmp_path / "rounds" / "round-000001.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completions": ["x", "y", "z"], "rewards": [1, 0, 0]}) + "\n")
    zero = _feed(tmp_path, tokenizer, is_zero=True)
    reason = zero.ready(1)
    assert reason is not None and "3 completions, not a multiple of the global batch size 2" in reason
    assert str(bad) in reason
    assert not (tmp_path / "run" / "rollouts" / "round-000001.done.json").exists()
    assert not (tmp_path / "run" / "rollouts" / "round-000001.bin").exists()  # nothing a rank could read


def test_the_dataset_gives_the_old_logprobs_of_the_labels(tmp_path: Path, tokenizer: Path) -> None:
    from megalaunch.runtime.flows.rollout_data import RolloutDataset, Round
    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    renderer = ChatRenderer(tokenizer)
    enc = renderer.encode([{"role": "user", "content": "red"}, {"role": "assistant", "content": "cat"}], 1)
    start = enc.mask.index(1)
    ids = enc.tokens[start:start + sum(enc.mask)]
    rows = [{"prompt": "red", "completion": "cat", "reward": 1.0, "uid": 1, "completion_ids": ids,
             "old_logprobs": [-0.25 * (i + 1) for i in range(len(ids))]},
            {"prompt": "red", "completion": "dog", "reward": 0.0, "uid": 1}]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenize_rollouts(src, tmp_path / "out" / "r", renderer)
    ds = RolloutDataset.__new__(RolloutDataset)  # the sample logic only (Megatron's config stands in)
    ds.config, ds.pad = SimpleNamespace(sequence_length=32), 0
    sample = ds.sample((Round(tmp_path / "out" / "r"), 0))
    old = sample["old_logprobs"].numpy()
    labels, mask = sample["labels"].numpy(), sample["loss_mask"].numpy()
    assert list(labels[start - 1:start - 1 + len(ids)]) == ids  # label t is token t + 1
    assert list(old[start - 1:start - 1 + len(ids)]) == pytest.approx([-0.25 * (i + 1) for i in range(len(ids))])
    assert numpy.isnan(old[:start - 1]).all() and mask[start - 1] == 1
    assert float(sample["advantages"][0]) == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-4))  # (1 - .5) / (std + 1e-4)


def test_the_stop_signal_cuts_a_wait_short_and_the_wait_resumes_later(tmp_path: Path, tokenizer: Path) -> None:
    from megalaunch.runtime.flows.rollout_feed import INTERRUPTED

    zero = _feed(tmp_path, tokenizer, is_zero=True, wait_s=1e9)  # would wait for ever: the signal ends it
    assert zero.ready(1, lambda: True) == INTERRUPTED
    other = _feed(tmp_path, tokenizer, is_zero=False, wait_s=1e9)
    assert other.ready(1) == INTERRUPTED  # freed by rank 0's verdict, without a signal of its own
    _round(tmp_path / "rounds", 1, 1)
    assert zero.ready(1) is None  # not cached: asked again, the wait goes on and the round is brought in


def test_the_rollouts_old_logprobs_come_first_then_the_stages(tmp_path: Path, tokenizer: Path) -> None:
    """A round where one completion gives old log-probabilities and the other does not: the dataset takes the
    given ones, and the stage's stored rows (RUN/scores/old/<round>, aligned as the reference's) for the rest."""
    from megalaunch.runtime.flows.rollout_data import RolloutDataset, Round
    from megalaunch.runtime.flows.rollout_old import needs_scoring
    from megalaunch.runtime.scoring.store import Documents, ScoreWriter
    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    renderer = ChatRenderer(tokenizer)
    enc = renderer.encode([{"role": "user", "content": "red"}, {"role": "assistant", "content": "cat"}], 1)
    start = enc.mask.index(1)
    ids = enc.tokens[start:start + sum(enc.mask)]
    rows = [{"prompt": "red", "completion": "cat", "reward": 1.0, "uid": 1, "completion_ids": ids,
             "old_logprobs": [-0.25] * len(ids)},
            {"prompt": "red", "completion": "dog", "reward": 0.0, "uid": 1}]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = tmp_path / "out" / "r"
    tokenize_rollouts(src, prefix, renderer)
    assert needs_scoring(prefix)  # the second completion has none
    docs = Documents(prefix)
    writer = ScoreWriter(tmp_path / "old", kind="logprobs", prefixes=[str(prefix)],
                         model={"fingerprint": "f", "source": "s"})
    # row j of document d: -(j + 10 d) / 100 (row 0 unused), as the stage writes log p(token j | < j)
    writer.append("r", [numpy.array([0.0] + [-(j + 10 * d) / 100 for j in range(1, docs.lengths[d])], "float32")
                        for d in range(len(docs))])
    writer.flush(complete=True)
    writer.close()
    ds = RolloutDataset.__new__(RolloutDataset)
    ds.config, ds.pad = SimpleNamespace(sequence_length=32), 0
    rnd = Round(prefix, old_scores=tmp_path / "old")
    given, stored = ds.sample((rnd, 0))["old_logprobs"].numpy(), ds.sample((rnd, 1))
    mask = stored["loss_mask"].numpy()
    assert list(given[start - 1:start - 1 + len(ids)]) == [-0.25] * len(ids)  # the rollouts' own
    assert given[0] == pytest.approx(-0.01)  # the stage's where the row gave none (label 0 is token 1)
    n = int(docs.lengths[1])
    want = [-(t + 1 + 10) / 100 for t in range(n - 1)]  # label t is token t + 1 of document 1
    assert stored["old_logprobs"].numpy()[:n - 1].tolist() == pytest.approx(want) and mask[:n - 1].sum() > 0
