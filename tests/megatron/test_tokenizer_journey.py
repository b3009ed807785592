"""The tokenizer that tokenization takes is the one training and conversion take: Megatron's real
training loop (`tiny`, CPU) trains with a bare tokenizer.json and with a directory holding only
tokenizer.json, and the converted Hugging Face directory alone gives transformers a model and a
tokenizer that agree on the special tokens and generate. The tokenizer is trained here (no downloads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import torch
from harness import Trainer, make_run
from tests.support.corpus import documents, train_bpe_tokenizer

from megalaunch.conversion import mcore_to_hf
from megalaunch.conversion.errors import ConversionError

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_train_with_a_tokenizer_json_and_convert_with_its_tokenizer(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_json = train_bpe_tokenizer(tmp_path / "tok" / "tokenizer.json", list(documents(60, mean_words=40)),
                                         vocab_size=400)
    ref = tokenizer_json if kind == "file" else tokenizer_json.parent
    paths = make_run(tmp_path / "runs", "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={ref}",
                     "training.train_iters=2", "checkpoint.save_interval=2", "training.lr_warmup_iters=1")
    trainer = Trainer(paths)
    assert trainer.wait() == [0], trainer.log()[-3000:]
    assert "padded vocab (size: 400)" in trainer.log()

    out = tmp_path / "hf"
    mcore_to_hf(paths.root, out, progress=False)
    shutil.rmtree(tmp_path / "tok")  # the output directory alone, nothing the run pointed at
    eos = json.loads(paths.manifest.read_text())["tokenizer"]["eos_token_id"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 400 and len(tokenizer) == 400
    assert cfg["eos_token_id"] == tokenizer.eos_token_id == eos
    assert cfg["bos_token_id"] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    prompt = tokenizer("Kara dor vi", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0]), str)

    # a --hf-template with only a config.json: its config, the run's tokenizer
    (tmp_path / "cfg-only").mkdir()
    shutil.copy(out / "config.json", tmp_path / "cfg-only" / "config.json")
    mcore_to_hf(paths.root, tmp_path / "hf-tpl", hf_template=tmp_path / "cfg-only", progress=False)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf-tpl").eos_token_id == eos


def test_hf_template_may_be_a_tokenizer_directory(tmp_path: Path) -> None:
    """The null-tokenizer run has no tokenizer of its own: a tokenizer-only --hf-template gives it one;
    a directory with neither config.json nor tokenizer files is refused in one line."""
    from transformers import AutoTokenizer

    paths = make_run(tmp_path / "runs", "training.train_iters=1", "checkpoint.save_interval=1",
                     "training.lr_warmup_iters=0", "data.vocab_size=400")
    trainer = Trainer(paths)
    assert trainer.wait() == [0], trainer.log()[-3000:]
    tok_dir = train_bpe_tokenizer(tmp_path / "tok" / "tokenizer.json", list(documents(60, mean_words=40)),
                                  vocab_size=400).parent
    mcore_to_hf(paths.root, tmp_path / "hf", hf_template=tok_dir, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match=r"no config\.json and no tokenizer files") as e:
        mcore_to_hf(paths.root, tmp_path / "hf2", hf_template=tmp_path / "empty", progress=False)
    assert "\n" not in str(e.value)
