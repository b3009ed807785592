"""Rollout files for GRPO (data/rollouts.py, tokenization/rollout_build.py): the shapes of TRL's, verl's and
OpenRLHF's dumps read into groups, advantages as TRL computes them (written out here independently),
bad rows named by file and row with nothing written, and the tokenized chat data with its side files
(advantages per conversation, old log-probabilities aligned per token)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy
import pytest

from megalaunch.data.rollouts import RolloutError, read_rollouts


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5  # Bessel, like torch.std
    return [(r - mean) / (std + 1e-4) for r in rewards]


def test_grouped_rows_give_trl_advantages(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "r.jsonl", [
        {"prompt": "two plus two", "completions": ["4", "5", "four"], "rewards": [1, 0, 1]},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "completions": [[{"role": "assistant", "content": "hello"}], {"role": "assistant", "content": "yo"}],
         "scores": [0.5, 0.5]},
    ])
    groups = read_rollouts(f)
    assert [len(g.completions) for g in groups] == [3, 2]
    assert groups[0].prompt == [{"role": "user", "content": "two plus two"}]
    assert groups[0].advantages() == pytest.approx(_advantages([1, 0, 1]))
    assert groups[1].advantages() == [0.0, 0.0]  # equal rewards: nothing to prefer
    assert groups[1].completions[1].answer == [{"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("names", [("prompt", "completion", "reward", "group"),  # TRL-like, with a key
                                   ("input", "output", "score", "uid"),  # verl's dump
                                   ("query", "response", "reward", "prompt_id")])
def test_one_completion_per_row_is_grouped_by_its_key(tmp_path: Path, names: tuple[str, ...]) -> None:
    p, c, r, g = names
    rows = [{p: f"q{i % 2}", c: f"a{i}", r: float(i), g: i % 2} for i in range(6)]
    groups = read_rollouts(_jsonl(tmp_path / "r.jsonl", rows))
    assert [[x.row for x in grp.completions] for grp in groups] == [[1, 3, 5], [2, 4, 6]]
    assert groups[0].advantages() == pytest.approx(_advantages([0.0, 2.0, 4.0]))


def test_rows_without_a_key_are_grouped_by_prompt(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "completion": "x", "reward": 1}, {"prompt": "b", "completion": "y", "reward": 0},
            {"prompt": "a", "completion": "z", "reward": 0}, {"prompt": "b", "completion": "w", "reward": 1}]
    groups = read_rollouts(_jsonl(tmp_path / "r.jsonl", rows))
    assert [[c.answer[0]["content"] for c in g.completions] for g in groups] == [["x", "z"], ["y", "w"]]


def test_bad_rows_are_named_by_file_and_row(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "a", "completion": "x", "reward": 1, "group": 1},
        {"prompt": "a", "completion": "y", "group": 1},  # 2: no reward
        "{not json",  # 3
        {"prompt": "a", "completion": "z", "reward": float("nan"), "group": 1},  # 4 (json.dumps writes NaN)
        {"prompt": "b", "completions": ["p"], "rewards": [1, 2]},  # 5: lengths
        {"prompt": "c", "completion": "q", "reward": 1, "group": 7},  # 6: a group of one
        {"prompt": "a", "completion": "v", "reward": 1, "score": 2, "group": 1},  # 7: ambiguous
        {"prompt": "a", "completion": "v", "reward": 1, "group": 1, "logprobs": [-1.0], "completion_ids": [3, 4]},
        {"prompt": "a", "completion": "v", "reward": True, "group": 1},  # 9: a bool is no reward
    ])
    with pytest.raises(RolloutError) as e:
        read_rollouts(f)
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and "nothing of this file was used" in msg
    for n, words in ((2, "no reward"), (3, "not JSON"), (4, "finite number"), (5, "1 completions but 2 rewards"),
                     (6, "one completion"), (7, "both 'reward' and 'score'"), (8, "1 old log-probabilities for 2"),
                     (9, "finite number")):
        assert re.search(rf"row {n}: [^;]*{re.escape(words)}", msg), (n, msg)
    assert "row 1:" not in msg


def test_a_group_with_two_prompts_is_refused(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "completion": "x", "reward": 1, "uid": "u"},
                                      {"prompt": "b", "completion": "y", "reward": 0, "uid": "u"}])
    with pytest.raises(RolloutError, match="row 2: group 'u' has another prompt at row 1"):
        read_rollouts(f)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.support.chat import make_chat_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_chat_tokenizer(out)
    return out


def test_tokenized_rollouts_carry_advantages_and_aligned_old_logprobs(tmp_path: Path, tokenizer: Path) -> None:
    from megalaunch.runtime.flows.chat_dataset import ChatDocuments
    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    renderer = ChatRenderer(tokenizer)
    whole = renderer.encode([{"role": "user", "content": "red cat"}, {"role": "assistant", "content": "cat red"}], 1)
    start = whole.mask.index(1)
    ids = whole.tokens[start:start + sum(whole.mask)]  # what a generator with this template produced
    logps = [-0.5 - i for i in range(len(ids))]
    f = _jsonl(tmp_path / "r.jsonl", [
        {"prompt": "red cat", "completions": ["cat red", "dog"], "rewards": [1.0, 0.0],
         "old_logprobs": [logps, None], "completion_ids": [ids, None]},
        {"prompt": "sun moon", "completion": "moon sun", "reward": 2.0, "uid": 9},
        {"prompt": "sun moon", "completion": "sun", "reward": 1.0, "uid": 9},
    ])
    stats = tokenize_rollouts(f, tmp_path / "out" / "r", renderer)
    assert (stats.groups, stats.conversations, stats.old_logprobs) == (2, 4, True)
    docs = ChatDocuments(str(tmp_path / "out" / "r"))
    assert len(docs) == 4 and list(docs.get(0)[0]) == whole.tokens
    adv = numpy.fromfile(tmp_path / "out" / "r.adv", dtype="<f4")
    assert adv == pytest.approx(_advantages([1, 0]) + _advantages([2, 1]), abs=1e-6)
    assert list(numpy.fromfile(tmp_path / "out" / "r.reward", dtype="<f4")) == [1.0, 0.0, 2.0, 1.0]
    old = numpy.fromfile(tmp_path / "out" / "r.oldlogp", dtype="<f4")
    assert len(old) == stats.tokens
    first = old[:len(whole.tokens)]
    assert list(first[start:start + len(ids)]) == pytest.approx(logps)  # row j: log p_old(token j | < j)
    assert numpy.isnan(first[:start]).all() and numpy.isnan(old[len(whole.tokens):]).all()


def test_token_ids_that_differ_from_the_template_refuse_the_row(tmp_path: Path, tokenizer: Path) -> None:
    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    f = _jsonl(tmp_path / "r.jsonl", [
        {"prompt": "red", "completion": "blue", "reward": 1.0, "uid": 1},
        {"prompt": "red", "completion": "blue", "reward": 0.0, "uid": 1, "logprobs": [-1.0, -2.0],
         "response_ids": [7, 7]},
    ])
    with pytest.raises(RolloutError, match=r"r\.jsonl: 1 bad row \(row 2: its token ids differ"):
        tokenize_rollouts(f, tmp_path / "out" / "r", ChatRenderer(tokenizer))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert math.isfinite(1.0)


def _bad_round(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    _jsonl(directory / "round-000001.jsonl", [{"prompt": "a", "completions": ["x", "y"], "rewards": [1, 0]}])
    return _jsonl(directory / "round-000002.jsonl", [{"prompt": "a", "completions": ["x", "y"], "rewards": [1, 0]},
                                                     {"prompt": "b", "completions": ["x", "y"], "rewards": [1, "?"]}])


def test_submit_refuses_a_round_with_a_bad_row_in_one_line(tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.preflight import check_files
    from megalaunch.errors import PreflightError

    bad = _bad_round(tmp_path / "rounds")
    with pytest.raises(PreflightError) as e:
        check_files(load_recipe("grpo-tiny", [f"post_training.rollouts={tmp_path / 'rounds'}"]).recipe)
    assert "\n" not in str(e.value) and f"{bad}: 1 bad row (row 2: 'rewards[1]' must be a finite number" in str(e.value)
    assert e.value.field == "post_training.rollouts"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(PreflightError, match="neither a rollout file nor a directory"):
        check_files(load_recipe("grpo-tiny", [f"post_training.rollouts={tmp_path / 'fifo'}"]).recipe)
    check_files(load_recipe("grpo-tiny", [f"post_training.rollouts={tmp_path / 'later'}"]).recipe)  # made later: waits
    (tmp_path / "rounds" / "round-000002.jsonl").unlink()
    check_files(load_recipe("grpo-tiny", [f"post_training.rollouts={tmp_path / 'rounds'}"]).recipe)  # fine


def test_data_rollouts_names_the_bad_row_and_writes_nothing(tmp_path: Path, tokenizer: Path) -> None:
    import subprocess
    import sys

    bad = _bad_round(tmp_path / "rounds")
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "data", "rollouts", str(bad), "--tokenizer",
                           str(tokenizer), "--output", str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}: 1 bad row (row 2:" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_kl_without_hugging_face_starting_weights_is_refused_at_submit(tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.preflight import check_files
    from megalaunch.errors import PreflightError

    with pytest.raises(PreflightError) as e:
        check_files(load_recipe("grpo-tiny", ["post_training.kl_coeff=0.05",
                                              f"post_training.rollouts={tmp_path}"]).recipe)
    assert e.value.field == "post_training.kl_coeff" and "submit --from-hf DIR" in str(e.value)


def test_parquet_rollouts_are_read_like_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({  # a struct column gives every message every key: null ones are dropped
        "prompt": [[{"role": "user", "content": "hi", "name": None}]] * 2,
        "completion": [[{"role": "assistant", "content": "a", "name": None}],
                       [{"role": "assistant", "content": "b", "name": "bot"}]],
        "score": [1.0, 0.0], "uid": ["u", "u"]})
    pq.write_table(table, tmp_path / "r.parquet")
    [group] = read_rollouts(tmp_path / "r.parquet")
    assert group.prompt == [{"role": "user", "content": "hi"}]
    assert [c.answer for c in group.completions] == [[{"role": "assistant", "content": "a"}],
                                                     [{"role": "assistant", "content": "b", "name": "bot"}]]
    assert group.advantages() == pytest.approx(_advantages([1.0, 0.0]))


def test_a_round_the_job_cannot_trust_is_refused_without_blocking(tmp_path: Path) -> None:
    """The generator's directory may be a team member's: a FIFO named as a round would block whoever opens it, a
    link may point at the owner's private files, a hard link may be swapped under the job. Each is refused in
    one line naming the file; the check at submit (check_rollout_source) says the same."""
    from megalaunch.data.rollouts import check_rollout_source

    rows = [{"prompt": "p", "completions": ["a", "b"], "rewards": [1, 0]}]
    good = _jsonl(tmp_path / "good.jsonl", rows)
    rounds = tmp_path / "rounds"
    rounds.mkdir()
    os.mkfifo(rounds / "round-000001.jsonl")
    with pytest.raises(RolloutError, match=r"round-000001\.jsonl is a fifo, not a regular file"):
        read_rollouts(rounds / "round-000001.jsonl")  # returns at once: never opened for reading
    with pytest.raises(RolloutError, match="fifo"):
        check_rollout_source(rounds)
    (rounds / "round-000001.jsonl").unlink()
    (rounds / "round-000001.jsonl").symlink_to(good)
    with pytest.raises(RolloutError, match="symlink"):
        read_rollouts(rounds / "round-000001.jsonl")
    (rounds / "round-000001.jsonl").unlink()
    os.link(good, rounds / "round-000001.jsonl")
    with pytest.raises(RolloutError, match="hard link"):
        read_rollouts(rounds / "round-000001.jsonl")
    assert len(read_rollouts(_jsonl(tmp_path / "other.jsonl", rows))) == 1


def test_the_recorded_sha256_is_of_the_bytes_tokenized(tmp_path: Path, tokenizer: Path) -> None:
    """The round is read once: its sha256 in the marker (and RUN/rollouts/record.jsonl) is of the rows trained on."""
    import hashlib

    from megalaunch.tokenization.chat.render import ChatRenderer
    from megalaunch.tokenization.rollout_build import tokenize_rollouts

    f = _jsonl(tmp_path / "r.jsonl", [{"prompt": "red cat", "completions": ["cat red", "red"], "rewards": [1, 0]}])
    stats = tokenize_rollouts(f, tmp_path / "out" / "r", ChatRenderer(tokenizer))
    assert stats.source_sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
