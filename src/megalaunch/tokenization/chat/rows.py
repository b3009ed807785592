"""Conversation rows from JSONL or parquet files, checked one by one: a row is either a conversation
(`{"messages": [{"role": ..., "content": ...}, ...]}`) or a prompt/response pair (`{"prompt": ...,
"response": ...}`, optionally `"system"`; `completion` is accepted for `response`), or a preference
pair (`{"prompt": ... or "messages": [...], "chosen": ..., "rejected": ...}`, each answer a text or
a list of assistant messages; written as two conversations, chosen then rejected). ShareGPT rows
(`{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`) are read as messages
(human -> user, gpt -> assistant, function_call -> assistant, observation/function -> tool). A row that is
neither is *malformed*: it is counted and named by its 1-based row number, never dropped silently.
Standard library only (parquet needs pyarrow)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.data.jsonl import json_lines

Message = dict[str, Any]
SUFFIXES = (".jsonl", ".json", ".parquet")
FORMATS = ('{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
           'or {"prompt": "...", "response": "..."}')


@dataclass(frozen=True)
class Row:
    """One input row: its 1-based number and either its messages or why it is malformed."""

    number: int
    messages: list[Message] | None = None
    problem: str | None = None
    rejected: list[Message] | None = None  # a preference pair: `messages` is the chosen conversation
    answer_from: int = 0  # a preference pair: its answers start at this message (the rest is context)


def read_rows(path: Path) -> Iterator[Row]:
    """Every row of a .jsonl (blank lines skipped, still counted) or .parquet file, checked."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    with open(path, "rb") as f:
        for number, record, problem in json_lines(f):
            yield Row(number, problem=problem) if problem else check_record(number, record)


def _parquet_rows(path: Path) -> Iterator[Row]:
    from megalaunch.errors import require

    require("pyarrow", "tokenize")
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield check_record(number, record)


def check_record(number: int, record: Any) -> Row:
    """The row's messages, or the first thing wrong with it."""
    if not isinstance(record, dict):
        return Row(number, problem=f"a row must be a JSON object, got {type(record).__name__}")
    if "chosen" in record or "rejected" in record:
        return _preference(number, record)
    if "messages" in record and record["messages"] is not None:
        return _check_messages(number, record["messages"])
    if isinstance(record.get("conversations"), list):
        return _check_messages(number, [_from_sharegpt(m) for m in record["conversations"]])
    response = record.get("response", record.get("completion"))
    if "prompt" in record or response is not None:
        return _pair(number, record, response)
    return Row(number, problem="neither 'messages' nor 'prompt'/'response'")


def _pair(number: int, record: dict[str, Any], response: Any) -> Row:
    prompt, system = record.get("prompt"), record.get("system")
    for name, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str) or not value:
            return Row(number, problem=f"'{name}' must be non-empty text")
    if system is not None and not isinstance(system, str):
        return Row(number, problem="'system' must be text")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return Row(number, messages=messages)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "function": "tool", "tool": "tool"}


def _from_sharegpt(m: Any) -> Any:
    """A ShareGPT turn ({"from", "value"}) as a message; anything else is left for the checks to name."""
    if isinstance(m, dict) and "from" in m and "role" not in m:
        return {"role": SHAREGPT_ROLES.get(str(m["from"]), m["from"]), "content": m.get("value")}
    return m


def _check_messages(number: int, messages: Any) -> Row:
    if not isinstance(messages, list):
        return Row(number, problem="'messages' must be a list of {role, content} objects")
    if not messages:
        return Row(number, problem="'messages' is empty")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return Row(number, problem=f"messages[{i}] is not an object")
        role = m.get("role")
        if not isinstance(role, str) or not role.strip():
            return Row(number, problem=f"messages[{i}] has no role")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            return Row(number, problem=f"messages[{i}] ({role}) has no content")
        if content is not None and not isinstance(content, (str, list)):
            return Row(number, problem=f"messages[{i}] ({role}): content must be text")
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        return Row(number, problem="no assistant message (nothing to learn from)")
    return Row(number, messages=out)


def _answer(value: Any, name: str) -> list[Message] | str:
    """A pair's answer as assistant messages, or what is wrong with it."""
    if isinstance(value, str) and value:
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and m.get("role") == "assistant"
                                                 and isinstance(m.get("content"), str) for m in value):
        return [dict(m) for m in value]
    return f"'{name}' must be non-empty text or a list of assistant messages"


def _preference(number: int, record: dict[str, Any]) -> Row:
    answers = {name: _answer(record.get(name), name) for name in ("chosen", "rejected")}
    for problem in answers.values():
        if isinstance(problem, str):
            return Row(number, problem=problem)
    if record.get("messages") is not None:
        prompt = _check_messages(number, [*record["messages"], {"role": "assistant", "content": "x"}])
        if prompt.messages is None:
            return prompt
        context = prompt.messages[:-1]
    else:
        pair = _pair(number, {**record, "response": "x"}, "x")
        if pair.messages is None:
            return pair
        context = pair.messages[:-1]
    chosen, rejected = answers["chosen"], answers["rejected"]
    assert not isinstance(chosen, str) and not isinstance(rejected, str)
    if chosen == rejected:  # h = 0 whatever the model: the pair only adds a constant to the loss
        return Row(number, problem="'chosen' and 'rejected' are the same answer (the pair teaches nothing)")
    return Row(number, messages=context + chosen, rejected=context + rejected, answer_from=len(context))
