"""Generated chat data and a tiny Hugging Face chat model (tokenizer with a chat template + random
Llama weights), built locally for the fine-tuning tests (no downloads)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rock"]


def chat_rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations whose answer follows from the prompt: the assistant repeats the user's words in
    reverse order. Every fourth one has a system message, every third a second user/assistant turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages: list[dict[str, str]] = []
        if i % 4 == 0:
            messages.append({"role": "system", "content": "reverse the words"})
        for _turn in range(2 if i % 3 == 0 else 1):
            words = rng.choices(WORDS, k=rng.randint(2, 4))
            messages.append({"role": "user", "content": " ".join(words)})
            messages.append({"role": "assistant", "content": " ".join(reversed(words))})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_chat_tokenizer(out: Path, *, template: str = LLAMA3_TEMPLATE, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer of exactly `vocab_size` entries with a chat template, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [" ".join(random.Random(s).choices(WORDS, k=12)) for s in range(300)] + ["reverse the words system user assistant tool"] * 40
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 40, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    filler = [f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(filler)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    eos = "<|eot_id|>" if template is LLAMA3_TEMPLATE else "<|im_end|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos,
                                 pad_token="<|end_of_text|>")
    hf.chat_template = template
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return hf


def make_chat_model(out: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """The tiny recipe's shape as a Hugging Face Llama with a chat tokenizer, saved to `out`."""
    from tests.support.hf_models import make_hf_model

    make_hf_model(out, "llama", vocab_size=vocab_size, rms_norm_eps=1e-5, max_position_embeddings=64, seed=seed)
    tok = make_chat_tokenizer(out, vocab_size=vocab_size)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def preference_rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """Pairs: the chosen answer reverses the prompt's words, the rejected one repeats them unchanged."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 4))
        rows.append({"prompt": " ".join(words), "chosen": " ".join(reversed(words)),
                     "rejected": " ".join(rng.choices(WORDS, k=len(words)))})
    return rows
