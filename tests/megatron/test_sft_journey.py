"""Fine-tuning end to end on the CPU (issue 26): a tiny chat model made and saved with transformers,
converted to Megatron, fine-tuned with the `sft-tiny` recipe on generated conversations (`megalaunch
data sft`) across three segments stopped by SIGUSR2; the loss on the assistant's tokens falls, the
losses equal an uninterrupted run's (exact resume), prompt-side targets carry no loss, and the result
converts back to a Hugging Face model that transformers chats with (chat template + generate)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from harness import FAST, ledger, losses, run_segment
from tests.support.chat import chat_rows, make_chat_model, write_jsonl

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.tokenization.chat.build import build

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 24


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF model, its conversion and the chat data (made once for the module's tests)."""
    root = tmp_path_factory.mktemp("sft")
    hf = make_chat_model(root / "hf")
    write_jsonl(root / "chats" / "train.jsonl", chat_rows(240))
    stats = build([str(root / "chats")], root / "data", tokenizer=hf, seq_length=64)
    assert stats[0].conversations == 240 and 0 < stats[0].trained_tokens < stats[0].tokens
    hf_to_mcore(hf, root / "converted", model=load_recipe("sft-tiny").recipe.model, vocab_size=512, progress=False)
    return {"root": root, "hf": hf, "data": root / "data", "converted": root / "converted"}


def _run(prepared: dict[str, Path], root: Path, name: str):
    sets = [*FAST, "training.global_batch_size=8", "training.micro_batch_size=4", f"training.train_iters={ITERS}",
            "checkpoint.save_interval=4", "checkpoint.keep_last=20", "data.mock=false",
            f"data.blend=[{{path: {prepared['data']}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prepared['hf']}", f"checkpoint.load={prepared['converted']}"]
    return write_run(prepare_run(load_recipe("sft-tiny", sets, name=name), root=root))


def test_sft_chain_resumes_exactly_and_converts_back_to_a_chat_model(prepared: dict[str, Path]) -> None:
    root = prepared["root"]
    straight = _run(prepared, root / "a", "straight")
    ref_log = root / "straight.jsonl"
    t = run_segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"
    assert str(prepared["converted"]) in t.log()  # started from the converted Hugging Face model

    chain = _run(prepared, root / "b", "chain")
    log = root / "chain.jsonl"
    stops = []
    for job, stop_after in (("201", 5), ("202", 5), ("203", None)):
        out = run_segment(chain, job, log, stop_after).outcome()
        assert out["status"] == ("finished" if stop_after is None else "saved"), out
        if stop_after is not None:
            stops.append(out["iteration"])
    consumed = [r["consumed_samples"] for r in ledger(chain, "resumed")]
    assert consumed == [8 * s for s in stops]  # global batch 8: consumed conversations continue exactly

    ref, got = losses(ref_log), losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}
    first, last = sum(ref[i] for i in (1, 2, 3)) / 3, sum(ref[i] for i in range(ITERS - 2, ITERS + 1)) / 3
    assert last < 0.7 * first, (first, last)  # the loss on the assistant's tokens falls

    _chat_with_the_result(chain, root / "back")


def _chat_with_the_result(chain, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mcore_to_hf(chain.root, out, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and "<|start_header_id|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "red cat sun"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    answer = generated[0, prompt["input_ids"].shape[1]:]
    assert len(answer) > 0 and isinstance(tokenizer.decode(answer), str)


def test_prompt_tokens_carry_no_loss(prepared: dict[str, Path], tmp_path: Path) -> None:
    """Changing only the prompt-side targets leaves the trainer's loss unchanged; changing one of the
    assistant's targets changes it (the real model, dataset and loss function)."""
    from tests.support.sft_loss import run_chat_losses

    model = dataclasses.asdict(load_recipe("sft-tiny").recipe.model)
    got = run_chat_losses(str(prepared["converted"] / "release"), model, str(prepared["data"] / "train"), 64,
                          str(tmp_path / "losses.pt"))
    own, prompt_changed, answer_changed = got["losses"]
    assert got["changed_prompt_labels"] > 10 and 0 < int(got["mask"].sum()) < len(got["mask"])
    assert prompt_changed == own
    assert answer_changed != own
