"""The chat dataset pads every tokenizer's conversations (issue #49: `submit --from-hf DIR --data CHATS` with a
tokenizer that has no pad token, as Llama 3's base models, failed in the job with "TypeError: '>=' not
supported between instances of 'NoneType' and 'int'"): no pad token, pad = eos, an added pad token, a
plain pad token, each through Megatron's own Hugging Face tokenizer as the job builds it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("megatron.core")
from tests.support.chat import chat_rows, make_chat_tokenizer, write_jsonl

from megalaunch.runtime.flows.chat_dataset import padding_token
from megalaunch.tokenization.chat.build import build

SEQ = 64
# tokenizer shape -> the padding token expected (make_chat_tokenizer: 512 entries, pad <|end_of_text|> = 1,
# eos <|eot_id|> = 4)
SHAPES = {"no-pad": 0, "pad-is-eos": 0, "added-pad": 512, "own-pad": 1}


def tokenizer_dir(base: Path, shape: str, out: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    if shape == "no-pad":
        tok.pad_token = None
    elif shape == "pad-is-eos":
        tok.pad_token = tok.eos_token
    elif shape == "added-pad":
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chatpad")
    make_chat_tokenizer(root / "tok")
    write_jsonl(root / "in" / "chats.jsonl", chat_rows(6))
    return root


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_tokenizer_shape_pads_its_conversations(base: Path, shape: str, tmp_path: Path) -> None:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    from megalaunch.runtime.flows.chat_dataset import ChatDataset, ChatDocuments

    tok_dir = tokenizer_dir(base / "tok", shape, tmp_path / "tok")
    build([str(base / "in")], tmp_path / "data", tokenizer=tok_dir)
    prefix = str(tmp_path / "data" / "chats")
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=str(tok_dir), metadata_path={"library": "huggingface"})
    if shape == "no-pad":
        assert tokenizer.pad is None  # what made `>=` fail
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ, blend=([prefix], None), split="100,0,0",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    docs = ChatDocuments(prefix)
    collides = pytest.warns(UserWarning, match="collides") if shape == "pad-is-eos" else contextlib.nullcontext()
    with collides:  # Megatron resets a pad id that is also the end of text to -1
        dataset = ChatDataset(docs, prefix, numpy.arange(len(docs)), 4, Split.train, config)
    assert dataset.pad == SHAPES[shape]
    for i in range(4):
        sample = dataset[i]
        ids, _ = docs.get(int(dataset.indices[dataset.order[i]]))
        n = len(ids)
        assert n < SEQ
        assert sample["tokens"][:n].tolist() == ids.tolist()
        assert (sample["tokens"][n:] == SHAPES[shape]).all() and (sample["labels"][n - 1:] == SHAPES[shape]).all()
        assert not sample["loss_mask"][n - 1:].any() and sample["loss_mask"][:n - 1].any()
        assert int(sample["tokens"].max()) < tokenizer.vocab_size
    assert (dataset[None]["tokens"] == SHAPES[shape]).all() and not dataset[None]["loss_mask"].any()


@pytest.mark.parametrize(("pad", "vocab", "expected"), [
    (None, 512, 0), (-1, 512, 0), (7, 512, 7), (numpy.int64(7), numpy.int64(512), 7), (512, 513, 512),
    (600, 512, 0), (3, None, 3), (True, 512, 0), ("1", 512, 0),
])
def test_padding_token_is_an_id_of_the_vocabulary(pad: object, vocab: object, expected: int) -> None:
    got = padding_token(pad, vocab)
    assert got == expected and type(got) is int
