"""A chat template without a system role (issue #49): a conversation that opens with a system message is
trained with it folded into the first user turn ("SYSTEM\n\nUSER"), counted in the marker; a row the template
refuses for another reason is still refused in one line naming the file and the row."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests.support.chat import make_chat_tokenizer, write_jsonl

from megalaunch.errors import PreflightError
from megalaunch.tokenization.chat.build import build
from megalaunch.tokenization.chat.render import fold_system

NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% elif m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
             "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red cat"},
          {"role": "assistant", "content": "cat red"}]


def test_fold_system_puts_the_system_message_into_the_first_user_turn() -> None:
    assert fold_system(SYSTEM) == [{"role": "user", "content": "be brief\n\nred cat"}, SYSTEM[2]]
    assert fold_system(SYSTEM[1:]) is None  # nothing to fold
    assert fold_system([*SYSTEM, {"role": "system", "content": "again"}]) is None  # a later system message


def test_a_template_without_a_system_role_trains_the_folded_conversation(tmp_path: Path) -> None:
    tok = make_chat_tokenizer(tmp_path / "tok", template=NO_SYSTEM)
    write_jsonl(tmp_path / "in" / "c.jsonl", [{"messages": SYSTEM}, {"messages": SYSTEM[1:]}])
    [stats] = build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert (stats.conversations, stats.folded_system, stats.malformed) == (2, 1, [])
    import numpy

    tokens = numpy.fromfile(tmp_path / "out" / "c.bin", dtype=numpy.uint16)  # 512 entries: uint16 tokens
    assert tok.decode(tokens.tolist()).startswith("<|im_start|>user\nbe brief\n\nred cat<|im_end|>")


def test_a_row_the_template_refuses_otherwise_is_named(tmp_path: Path) -> None:
    make_chat_tokenizer(tmp_path / "tok", template=NO_SYSTEM)
    tool = [*SYSTEM[:2], {"role": "tool", "content": "x"}, SYSTEM[2]]
    write_jsonl(tmp_path / "in" / "c.jsonl", [{"messages": SYSTEM}, {"messages": tool}])
    with pytest.raises(PreflightError) as e:
        build([str(tmp_path / "in")], tmp_path / "out", tokenizer=tmp_path / "tok")
    message = str(e.value)
    assert "\n" not in message and "c.jsonl: 1 malformed row (row 2: the chat template failed" in message
    assert "with the system message folded into the first user turn: the chat template failed" in message
    assert "no tools" in message
