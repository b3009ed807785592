"""`megalaunch data sft`: conversations rendered with the model's own chat template, the loss mask on
exactly the assistant's tokens (any template whose prefixes render as prefixes; multi-turn, system and
tool roles, prompt/response pairs, parquet), malformed rows named by number with nothing written,
and a relaunch that skips the files already done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests.support.chat import CHATML_TEMPLATE, LLAMA3_TEMPLATE, chat_rows, make_chat_tokenizer, write_jsonl
from tests.unit.helpers import cli
from typer.testing import CliRunner

from megalaunch.cli.main import app
from megalaunch.errors import PreflightError
from megalaunch.tokenization.chat.build import build
from megalaunch.tokenization.chat.render import ChatRenderer
from megalaunch.tokenization.chat.rows import check_record


def _masked_text(renderer: ChatRenderer, messages: list[dict], start: int = 0) -> list[str]:
    """The trained tokens, decoded run by run (each run of 1s in the mask)."""
    enc = renderer.encode(messages, start)
    runs, current = [], []
    for t, m in zip(enc.tokens, enc.mask, strict=True):
        if m:
            current.append(t)
        elif current:
            runs.append(renderer.tokenizer.decode(current))
            current = []
    if current:
        runs.append(renderer.tokenizer.decode(current))
    return runs


@pytest.mark.parametrize(("template", "end"), [(LLAMA3_TEMPLATE, "<|eot_id|>"), (CHATML_TEMPLATE, "<|im_end|>\n")])
def test_mask_covers_exactly_the_assistant_turns(template: str, end: str, tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok", template=template)
    renderer = ChatRenderer(tmp_path / "tok")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red cat"},
                {"role": "assistant", "content": "cat red"}, {"role": "tool", "content": "sun moon"},
                {"role": "user", "content": "blue dog fish"}, {"role": "assistant", "content": "fish dog blue"}]
    assert _masked_text(renderer, messages) == [f"cat red{end}", f"fish dog blue{end}"]
    enc = renderer.encode(messages)
    whole = renderer.tokenizer.apply_chat_template(messages, tokenize=False)
    assert renderer.tokenizer.decode(enc.tokens) == whole  # the model's own rendering, nothing added


def test_template_errors_and_unusable_templates_name_the_row(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok", template=CHATML_TEMPLATE)  # raises on roles it does not know
    rows = [*chat_rows(2), {"messages": [{"role": "critic", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    write_jsonl(tmp_path / "in" / "c.jsonl", rows)
    with pytest.raises(PreflightError, match=r"row 3: the chat template failed: .*unknown role critic"):
        build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert list((tmp_path / "out").iterdir()) == []

    # a template that renders only the last message: not even an answer follows its own prompt
    odd = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    make_chat_tokenizer(tmp_path / "odd", template=odd)
    with pytest.raises(PreflightError, match=r"row 1: the chat template does not render messages\[:3\] as its "
                                             r"prompt followed by the answer"):
        build([str(tmp_path / "in" / "c.jsonl")], tmp_path / "out2", tokenizer=tmp_path / "odd")


def test_malformed_file_is_refused_with_row_numbers_and_nothing_written(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok")
    good = json.dumps(chat_rows(1)[0]).encode()
    lines = [good, b'{"messages": [{"content": "no role"}, {"role": "assistant", "content": "a"}]}', b"",
             b'{"messages": []}', b"\xff\xfe not utf-8", b"[1, 2]", b'{"prompt": "red", "response": "der"}',
             b'{"messages": [{"role": "user", "content": "only a question"}]}', b"{not json"]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = cli("data", "sft", str(tmp_path / "in"), "--tokenizer", str(tmp_path / "tok"),
                 "--output", str(tmp_path / "out"))  # as a user runs it: the CLI's error boundary
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in err and not result.stdout
    for expected in ("6 malformed rows", "row 2: messages[0] has no role", "row 4: 'messages' is empty",
                     "row 5: not UTF-8 text", "row 6: a row must be a JSON object", "row 8: no assistant message",
                     "row 9: not JSON", "--skip-malformed"):
        assert expected in err, (expected, err)
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written

    stats = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok", skip_malformed=True)
    assert stats[0].conversations == 2 and [b["row"] for b in stats[0].malformed] == [2, 4, 5, 6, 8, 9]
    marker = json.loads((tmp_path / "out" / "bad.done.json").read_text())
    assert len(marker["malformed"]) == 6


def test_counts_pairs_parquet_and_resume(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megalaunch.data.index import read_index_header

    make_chat_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "in" / "a.jsonl", chat_rows(20))
    pairs = [{"prompt": "red cat", "response": "cat red", "system": None}, {"prompt": "sun", "response": "sun"}]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "in" / "b.parquet")
    result = CliRunner().invoke(app, ["data", "sft", str(tmp_path / "in"), "--tokenizer", str(tmp_path / "tok"),
                                      "--output", str(tmp_path / "out"), "--seq-length", "32", "--json"])
    assert result.exit_code == 0, result.output
    stats = {Path(s["input"]).name: s for s in json.loads(result.output)}
    assert stats["a.jsonl"]["conversations"] == 20 and stats["b.parquet"]["conversations"] == 2
    for name, s in stats.items():
        prefix = tmp_path / "out" / name.split(".")[0]
        header = read_index_header(str(prefix))
        mask = np.fromfile(str(prefix) + ".mask", dtype=np.uint8)
        assert header.token_count == s["tokens"] == len(mask) and header.sequence_count == s["conversations"]
        assert int(mask.sum()) == s["trained_tokens"] > 0
    assert stats["a.jsonl"]["over_seq_length"] > 0  # two-turn conversations exceed 33 tokens

    again = CliRunner().invoke(app, ["data", "sft", str(tmp_path / "in"), "--tokenizer", str(tmp_path / "tok"),
                                     "--output", str(tmp_path / "out"), "--json"])
    assert [s["skipped"] for s in json.loads(again.output)] == [True, True]
    write_jsonl(tmp_path / "in" / "a.jsonl", chat_rows(5))  # changed input: redone
    redo = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert [(s.skipped, s.conversations) for s in redo] == [(False, 5), (True, 2)]


def test_preference_pairs_are_two_conversations_and_files_do_not_mix(tmp_path: Path) -> None:
    from tests.support.chat import preference_rows

    from megalaunch.data.index import read_index_header

    make_chat_tokenizer(tmp_path / "tok")
    rows = [*preference_rows(3), {"messages": [{"role": "user", "content": "sun"}], "chosen": "nus",
                                  "rejected": [{"role": "assistant", "content": "moon"}]}]
    write_jsonl(tmp_path / "in" / "pairs.jsonl", rows)
    stats = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert (stats[0].pairs, stats[0].conversations) == (4, 8)
    # a pair trains its answer only, not the assistant turns of its context
    renderer = ChatRenderer(tmp_path / "tok")
    context = [{"role": "user", "content": "red"}, {"role": "assistant", "content": "der"},
               {"role": "user", "content": "sun"}]
    row = check_record(1, {"messages": context, "chosen": "nus", "rejected": "moon"})
    assert row.answer_from == 3
    assert _masked_text(renderer, row.messages, row.answer_from) == ["nus<|eot_id|>"]
    assert _masked_text(renderer, row.rejected, row.answer_from) == ["moon<|eot_id|>"]
    assert read_index_header(str(tmp_path / "out" / "pairs")).sequence_count == 8

    write_jsonl(tmp_path / "mixed" / "m.jsonl", [*preference_rows(1), *chat_rows(1), {"prompt": "a", "chosen": ""}])
    with pytest.raises(PreflightError, match=r"row 2: a single conversation in a file of preference pairs.*"
                                             r"row 3: 'chosen' must be non-empty text"):
        build([str(tmp_path / "mixed")], tmp_path / "out2", tokenizer=tmp_path / "tok")


# Qwen3-style: an earlier assistant turn is rendered without its reasoning, the last one with it.
REWRITING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_as_its_own_sample(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok", template=REWRITING_TEMPLATE)
    renderer = ChatRenderer(tmp_path / "tok")
    messages = [{"role": "user", "content": "red cat"}, {"role": "assistant", "content": "<think>r</think>cat red"},
                {"role": "user", "content": "sun"}, {"role": "assistant", "content": "<think>s</think>sun"}]
    encoded, split = renderer.encode_all(messages)
    assert split and len(encoded) == 2
    for enc, answer in zip(encoded, ("<think>r</think>cat red", "<think>s</think>sun"), strict=True):
        trained = renderer.tokenizer.decode([t for t, m in zip(enc.tokens, enc.mask, strict=True) if m])
        assert trained == f"{answer}<|im_end|>\n"
    write_jsonl(tmp_path / "in" / "c.jsonl", [{"messages": messages}, *chat_rows(3)])
    stats = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    # chat_rows have no reasoning to drop: rendered the same either way, one sample each
    assert (stats[0].split_turns, stats[0].conversations, stats[0].malformed) == (1, 5, [])


def test_sharegpt_rows_are_conversations(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok")
    rows = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "red cat"},
                               {"from": "gpt", "value": "cat red"}]},
            {"conversations": [{"from": "human", "value": "no answer"}]}]
    write_jsonl(tmp_path / "in" / "s.jsonl", rows)
    stats = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok", skip_malformed=True)
    assert stats[0].conversations == 1 and stats[0].malformed == [
        {"row": 2, "problem": "no assistant message (nothing to learn from)"}]
