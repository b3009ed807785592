"""A conversation -> token ids and a loss mask, with the model's own chat template.

The template (tokenizer_config.json's `chat_template`, or chat_template.jinja) is rendered by
transformers exactly as `apply_chat_template` renders it when one chats with the model. Which
characters belong to the assistant is found by rendering prefixes: for the assistant message i,

    before_i = render(messages[:i], add_generation_prompt=True)   # the prompt the model is given
    after_i  = render(messages[:i + 1])                            # ... plus its answer

and the characters between len(before_i) and len(after_i) of the whole rendering are the assistant's
(its text and whatever the template closes a turn with, e.g. `<|eot_id|>`, so the model learns to
stop). The whole text is then tokenized once and each token is trained on when its first character is
the assistant's.

A template whose renderings of a conversation's prefixes are not prefixes of the whole (one that
rewrites earlier turns, e.g. drops their reasoning) is handled turn by turn (`encode_all`): each
assistant turn becomes a sample of its own, `render(messages[:i + 1])`, trained on that turn only, so
every turn is trained on exactly as the template renders it when it is the last. Only where even that
fails (the answer does not follow its own prompt) is the row refused, with its number.

A template without a system role (Gemma's, Mistral's older ones: they raise on a system message) cannot
render a conversation that opens with one. Such a conversation is rendered with the system message folded
into the first user turn (`fold_system`: "SYSTEM\n\nUSER"), which is what the templates that do accept a
system message without having a slot for it (Llama 2's, Gemma's) do themselves: the instruction stays in the
prompt, and the model is later prompted the same way (its template refuses a system message at chat time
too). Folded conversations are counted (`folded_system`), never silent; a conversation whose template fails
for another reason is refused as before."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.tokenization.chat.rows import Message

TRAINED_ROLES = ("assistant",)


class RenderError(ValueError):
    """This conversation cannot be rendered with this template (the reason names what failed)."""


class PrefixError(RenderError):
    """The template does not render this conversation's prefixes as prefixes of the whole."""


@dataclass(frozen=True)
class Encoded:
    tokens: list[int]
    mask: list[int]  # 1: the token is a target the loss covers (an assistant's), 0: context


class ChatRenderer:
    """The tokenizer directory's tokenizer and chat template."""

    def __init__(self, tokenizer_dir: str | Path) -> None:
        from megalaunch.errors import PreflightError, require

        require("transformers", "convert")
        from transformers import AutoTokenizer

        self.source = Path(tokenizer_dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as e:
            raise PreflightError(f"cannot load the tokenizer {tokenizer_dir}: {str(e).splitlines()[0]}",
                                 field="--tokenizer", fix="give a Hugging Face model or tokenizer directory") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise PreflightError(f"{tokenizer_dir} has no chat template (tokenizer_config.json 'chat_template' "
                                 "or chat_template.jinja)", field="--tokenizer",
                                 fix="use the model's tokenizer directory, or add a chat template to it")
        if not getattr(self.tokenizer, "is_fast", False):
            raise PreflightError(f"{tokenizer_dir}: a fast tokenizer (tokenizer.json) is needed for the loss mask",
                                 field="--tokenizer", fix="save the tokenizer with tokenizer.json")
        self.vocab_size = len(self.tokenizer)

    def render(self, messages: list[Message], *, generation_prompt: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own raise_exception(), a Jinja error, a missing key
            raise RenderError(f"the chat template failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
        if not isinstance(text, str):
            raise RenderError("the chat template did not render text")
        return text

    def spans(self, messages: list[Message], start: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The whole rendering and the character spans of the assistant messages in it (from
        messages[start] on: a preference pair trains its answer, not the assistant turns of its context)."""
        whole = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] not in TRAINED_ROLES or i < start:
                continue
            before = self.render(messages[:i], generation_prompt=True) if i else ""
            after = self.render(messages[: i + 1])
            if not (whole.startswith(before) and whole.startswith(after) and len(after) >= len(before)):
                raise PrefixError(f"the chat template does not render messages[:{i + 1}] as a prefix of the "
                                  "whole conversation, so the assistant's tokens cannot be told apart")
            if len(after) > len(before):
                spans.append((len(before), len(after)))
        return whole, spans

    def encode(self, messages: list[Message], start: int = 0) -> Encoded:
        """The conversation as one sample, every assistant turn (from messages[start] on) trained on
        (PrefixError if the template cannot do that)."""
        return self._masked(*self.spans(messages, start))

    def encode_all(self, messages: list[Message]) -> tuple[list[Encoded], bool]:
        """One sample, or (True) one per assistant turn where the template rewrites earlier turns."""
        try:
            return [self.encode(messages)], False
        except PrefixError:
            pass
        out = []
        for i, m in enumerate(messages):
            if m["role"] not in TRAINED_ROLES:
                continue
            before = self.render(messages[:i], generation_prompt=True) if i else ""
            text = self.render(messages[: i + 1])
            if not text.startswith(before) or len(text) == len(before):
                raise RenderError(f"the chat template does not render messages[:{i + 1}] as its prompt "
                                  "followed by the answer, so the assistant's tokens cannot be told apart")
            out.append(self._masked(text, [(len(before), len(text))]))
        return out, True

    def _masked(self, whole: str, spans: list[tuple[int, int]]) -> Encoded:
        enc: Any = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        tokens = list(enc["input_ids"])
        mask = [0] * len(tokens)
        k = 0
        for j, (start, _end) in enumerate(enc["offset_mapping"]):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                mask[j] = 1
        if not tokens:
            raise RenderError("the conversation renders to no tokens")
        return Encoded(tokens, mask)


def fold_system(messages: list[Message]) -> list[Message] | None:
    """`messages` with its opening system message folded into the first user turn ("SYSTEM\n\nUSER");
    None when there is nothing to fold that way (no leading system message, another system message later,
    no user turn after it, or content that is not text)."""
    if not messages or messages[0]["role"] != "system" or any(m["role"] == "system" for m in messages[1:]):
        return None
    user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    system = messages[0].get("content")
    if user is None or not isinstance(system, str) or not isinstance(messages[user].get("content"), str):
        return None
    folded = [dict(m) for m in messages[1:]]
    folded[user - 1]["content"] = f"{system}\n\n{messages[user]['content']}"
    return folded
