"""Rollout files for GRPO's policy update (docs/post_training.md, "GRPO"): rows of JSONL or parquet in the
shapes that common RL frameworks dump, read and checked here, in one place (`FIELDS`), into groups of
completions of one prompt with a reward each, and the group-normalised advantages.

Two shapes of row:
- grouped: one prompt and its group, `{"prompt": ..., "completions": [...], "rewards": [...]}`;
- one completion per row, `{"prompt": ..., "completion": ..., "reward": ...}`, grouped by a group key
  (`group`, `prompt_id`, `uid`, `index`) where the row has one, else by the prompt itself (TRL's
  completion logs have none: the rows of one prompt are its group).
A prompt is text (the user's turn) or a list of chat messages; a completion is text (the assistant's
answer), one assistant message, or a list of assistant messages. Text is taken as it is, not as a rendered
template: the tokenizer's chat template wraps it (tokenization/chat/render.py).

Optional, per completion: the old policy's log-probabilities of the generated tokens and those tokens'
ids (`old_logprobs` + `completion_ids`, lists of the same length; grouped rows: a list per completion).
They are checked against the chat template's tokenization when the file is tokenized
(tokenization/rollout_build.py); without them the old policy is the current one at the update.

Every bad row (not JSON, a missing or non-finite reward, a group of one completion, lengths that do not
match, an ambiguous field, ...) is named by its 1-based row; nothing of the file is used
(`RolloutError`: one line with the file and the rows). Standard library only (parquet needs pyarrow), so
that `submit` checks the rounds already there on a login node (config/preflight.py, `check_rollout_source`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.data.jsonl import json_lines

Message = dict[str, Any]
SHOWN = 8  # bad rows named in the one-line error
MAX_ROUND_BYTES = 1 << 30  # a round file's bound (1 GiB of rows)
EPS = 1e-4  # TRL's GRPOTrainer: (r - mean) / (std + 1e-4)

# Our field -> the names it has in the dumps of common frameworks (first match wins; two names of one
# field in one row is an ambiguous row, refused).
#   TRL      GRPOTrainer completion logs: prompt, completion, reward (one row per completion, no group key);
#            its datasets: prompt / completion as text or conversational message lists
#   verl     trainer.rollout_data_dir dumps: input, output, score, step (+ reward extras); uid groups a prompt's
#            responses in its batch; old_log_probs and responses (ids) in its DataProto
#   OpenRLHF input / output / reward, prompt ids by index; logprobs of the actions
FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "input", "query"),
    "completions": ("completions", "responses", "outputs"),  # grouped rows
    "rewards": ("rewards", "scores"),  # grouped rows
    "completion": ("completion", "response", "output"),  # one completion per row
    "reward": ("reward", "score"),
    "group": ("group", "prompt_id", "uid", "index"),
    "old_logprobs": ("old_logprobs", "old_log_probs", "logprobs"),
    "token_ids": ("completion_ids", "response_ids"),
}
SHAPES = ('{"prompt": ..., "completions": [...], "rewards": [...]} or '
          '{"prompt": ..., "completion": ..., "reward": ..., "group": ...}')


class RolloutError(ValueError):
    """A rollout file that cannot be used: one line naming the file and its bad rows."""


class BadRow(ValueError):
    """What is wrong with one row (its number is added by the reader)."""


@dataclass(frozen=True)
class Completion:
    row: int  # 1-based row of the file
    answer: list[Message]
    reward: float
    old_logprobs: list[float] | None = None
    token_ids: list[int] | None = None


@dataclass
class Group:
    """One prompt's completions, in row order, and their advantages (`advantages`)."""

    key: str
    prompt: list[Message]
    row: int  # its first row
    completions: list[Completion] = field(default_factory=list)
    bad_rows: int = 0  # rows of this group refused (its size is not judged then: those rows are named)

    def advantages(self) -> list[float]:
        """(r - mean) / (std + 1e-4) over the group, std the sample standard deviation (n - 1), as TRL's
        GRPOTrainer computes it (torch.std's default); a group whose rewards are all equal gets zeros."""
        rewards = [c.reward for c in self.completions]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        return [(r - mean) / (std + EPS) for r in rewards]


def read_round_bytes(path: Path) -> bytes:
    """A rollout file's bytes, read once: the generator's directory may be another user's (a team member's
    service), so the file is opened as rundir/untrusted.py opens what members write: a regular file with one
    name, no link followed, never a FIFO that blocks the job, within MAX_ROUND_BYTES; else RolloutError."""
    from megalaunch.rundir.untrusted import Refused, open_member_file

    got = open_member_file(path, MAX_ROUND_BYTES)
    if got is None:
        raise RolloutError(f"{path} is not there")
    if isinstance(got, Refused):
        raise RolloutError(f"{path} is {got.why} (owner {got.owner}); a round is a regular file the generator "
                           "writes under another name and renames into place")
    return got.data


def read_rollouts(path: Path, data: bytes | None = None) -> list[Group]:
    """The file's groups (first-row order), or RolloutError naming every bad row; `data`: its bytes, read
    already (read_round_bytes)."""
    groups: dict[str, Group] = {}
    bad: list[tuple[int, str]] = []
    for number, record in _records(path, read_round_bytes(path) if data is None else data):
        try:
            if isinstance(record, BadRow):
                raise record
            _add(groups, number, record)
        except BadRow as e:
            bad.append((number, str(e)))
    for g in groups.values():
        if len(g.completions) < 2 and not g.bad_rows:
            bad.append((g.row, f"group {g.key!r} has one completion; GRPO's advantage compares at least two "
                               "completions of one prompt"))
    if bad:
        raise rollout_error(path, sorted(bad))
    if not groups:
        raise RolloutError(f"{path} holds no rollout; rows look like {SHAPES}")
    return list(groups.values())


def check_rollout_source(source: str | Path) -> int:
    """`post_training.rollouts` at submit: a file, or a directory (the generator's) whose rounds there now are
    read and checked (one not there yet: the job waits for its rounds); the number of rounds checked, or
    RolloutError (the file and its bad rows)."""
    import re

    path = Path(source).expanduser()
    if path.is_file():
        read_rollouts(path)
        return 1
    if not path.exists():  # the generator's directory, not made yet: the job waits for its first round
        return 0
    if not path.is_dir():
        raise RolloutError(f"{source} is neither a rollout file nor a directory of rounds")
    rounds = sorted(p for p in path.iterdir() if re.fullmatch(r"round-\d{6}\.(jsonl|parquet)", p.name))
    for p in rounds:
        read_rollouts(p)
    return len(rounds)


def rollout_error(path: Path, bad: list[tuple[int, str]]) -> RolloutError:
    shown = "; ".join(f"row {n}: {p}" for n, p in bad[:SHOWN])
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return RolloutError(f"{path}: {len(bad)} bad row{'s' if len(bad) > 1 else ''} ({shown}{more}); nothing of "
                        f"this file was used; rows look like {SHAPES}")


def _records(path: Path, data: bytes) -> Iterator[tuple[int, Any]]:
    if path.suffix == ".parquet":
        from megalaunch.errors import require

        require("pyarrow", "tokenize")
        import pyarrow
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(pyarrow.BufferReader(data)).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                number += 1
                yield number, record
        return
    for number, record, problem in json_lines(data.split(b"\n")):
        yield number, BadRow(problem) if problem else record


def pick(record: dict[str, Any], name: str) -> Any:
    """The row's value of our field `name` under any of its names (None: absent); two names: a bad row."""
    present = [k for k in FIELDS[name] if record.get(k) is not None]
    if len(present) > 1:
        raise BadRow(f"both {present[0]!r} and {present[1]!r} given for the {name}; keep one")
    return record[present[0]] if present else None


def _add(groups: dict[str, Group], number: int, record: Any) -> None:
    if not isinstance(record, dict):
        raise BadRow(f"a row must be a JSON object, got {type(record).__name__}")
    prompt = _prompt(pick(record, "prompt"))
    if pick(record, "completions") is not None or pick(record, "rewards") is not None:
        group = Group(f"row {number}", prompt, number)
        group.completions = _grouped(number, record)
        groups[group.key] = group
        return
    answer, reward = pick(record, "completion"), pick(record, "reward")
    if answer is None:
        raise BadRow(f"no completion ({'/'.join(FIELDS['completion'])}, or a group's "
                     f"{'/'.join(FIELDS['completions'])})")
    key_value = pick(record, "group")
    key = f"group {key_value!r}" if key_value is not None else json.dumps(prompt, sort_keys=True)
    group = groups.setdefault(key, Group(str(key_value) if key_value is not None else f"prompt of row {number}",
                                         prompt, number))
    if group.prompt != prompt:
        raise BadRow(f"group {group.key!r} has another prompt at row {group.row}; one group, one prompt")
    try:
        ids, logps = _tokens(pick(record, "token_ids"), pick(record, "old_logprobs"), "")
        group.completions.append(Completion(number, _answer(answer, "completion"), _reward(reward, "reward"),
                                            logps, ids))
    except BadRow:
        group.bad_rows += 1
        raise


def _grouped(number: int, record: dict[str, Any]) -> list[Completion]:
    answers, rewards = pick(record, "completions"), pick(record, "rewards")
    if not isinstance(answers, list) or not isinstance(rewards, list):
        raise BadRow("a grouped row needs 'completions' and 'rewards', both lists")
    if len(answers) != len(rewards):
        raise BadRow(f"{len(answers)} completions but {len(rewards)} rewards")
    ids_all, logps_all = pick(record, "token_ids"), pick(record, "old_logprobs")
    for name, value in (("token ids", ids_all), ("old log-probabilities", logps_all)):
        if value is not None and (not isinstance(value, list) or len(value) != len(answers)):
            raise BadRow(f"the {name} must be a list of one list per completion ({len(answers)})")
    out = []
    for i, (answer, reward) in enumerate(zip(answers, rewards, strict=True)):
        ids, logps = _tokens(ids_all[i] if ids_all is not None else None,
                             logps_all[i] if logps_all is not None else None, f" of completion {i}")
        out.append(Completion(number, _answer(answer, f"completions[{i}]"), _reward(reward, f"rewards[{i}]"),
                              logps, ids))
    return out


def _prompt(value: Any) -> list[Message]:
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        if value[-1]["role"] == "assistant":
            raise BadRow("the prompt's messages end with an assistant turn; the completion is the answer to it")
        return [_clean(m) for m in value]
    raise BadRow(f"no prompt ({'/'.join(FIELDS['prompt'])}: non-empty text or a list of {{role, content}} messages)")


def _clean(m: dict[str, Any]) -> Message:
    """A message without its null fields (a parquet struct column gives every key to every row)."""
    return {k: v for k, v in m.items() if v is not None}


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _answer(value: Any, name: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    value = [value] if isinstance(value, dict) else value
    if isinstance(value, list) and value and all(_is_message(m) and m["role"] == "assistant" for m in value):
        return [_clean(m) for m in value]
    raise BadRow(f"'{name}' must be text, an assistant message or a list of assistant messages")


def _reward(value: Any, name: str) -> float:
    if value is None:
        raise BadRow(f"no reward ('{name}')")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow(f"'{name}' must be a finite number, got {value!r}")
    return float(value)


def _tokens(ids: Any, logps: Any, where: str) -> tuple[list[int] | None, list[float] | None]:
    """The completion's token ids and old log-probabilities: both or neither, of one length."""
    if ids is None and logps is None:
        return None, None
    if ids is None or logps is None:
        raise BadRow(f"old log-probabilities{where} need the completion's token ids beside them "
                     f"({'/'.join(FIELDS['old_logprobs'])} with {'/'.join(FIELDS['token_ids'])})")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in ids):
        raise BadRow(f"the token ids{where} must be a non-empty list of token ids")
    if not isinstance(logps, list) or len(logps) != len(ids):
        raise BadRow(f"{len(logps) if isinstance(logps, list) else 'no list of'} old log-probabilities{where} "
                     f"for {len(ids)} tokens")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
               for x in logps):
        raise BadRow(f"the old log-probabilities{where} must be finite numbers <= 0")
    return list(ids), [float(x) for x in logps]
