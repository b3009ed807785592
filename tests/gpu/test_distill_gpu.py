"""Distillation on a GPU (run on the device machine; skipped without CUDA):

- the teacher stage in bf16 on the GPU: a ~1.1B Llama-shaped teacher (random weights, a 32,768-entry
  tokenizer) scores ~1,000 conversations of ~1,000 tokens; its rows match a float32 log-softmax of the same
  model to bf16's precision; tokens/s printed for the notes (also in meta.json);
- the tiny student learns a tiny teacher in bf16 on the GPU with the stored top-k and with the teacher online
  (transformers in the rank's process, on the same GPU): both train, their losses agree to bf16's precision.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_distill_gpu.py -s"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import FAST, Trainer, losses  # noqa: E402
from tests.support.chat import WORDS, chat_rows, make_chat_model, make_chat_tokenizer, write_jsonl  # noqa: E402

from megalaunch.config.loader import load_recipe  # noqa: E402
from megalaunch.conversion import hf_to_mcore  # noqa: E402
from megalaunch.launcher.prepare.prepare import prepare_run  # noqa: E402
from megalaunch.launcher.prepare.write import write_run  # noqa: E402
from megalaunch.runtime.scoring.store import ScoreReader, read_meta  # noqa: E402
from megalaunch.runtime.scoring.teacher import run_teacher_stage  # noqa: E402
from megalaunch.tokenization.chat.build import build  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = ("cluster.gpus_per_node=1", "cluster.tasks_per_node=1", "training.precision=bf16")


def _long_rows(n: int, words: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        said = rng.choices(WORDS, k=words)
        rows.append({"messages": [{"role": "user", "content": " ".join(said)},
                                  {"role": "assistant", "content": " ".join(reversed(said))}]})
    return rows


def _run(root: Path, data: Path, student: Path, teacher: Path, name: str, *more: str):
    sets = [*FAST, *GPU, "data.mock=false", f"data.blend=[{{path: {data}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={student}", f"post_training.teacher={teacher}", *more]
    return write_run(prepare_run(load_recipe("distill-tiny", sets, name=name), root=root))


def test_teacher_stage_bf16_throughput_and_rows(tmp_path: Path) -> None:
    from tests.support.hf_models import make_hf_model
    from transformers import AutoModelForCausalLM

    vocab = 32768
    teacher = tmp_path / "teacher"
    make_hf_model(teacher, "llama", dtype="bfloat16", vocab_size=vocab, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                  rms_norm_eps=1e-5)
    tok = make_chat_tokenizer(teacher, vocab_size=vocab)
    cfg = json.loads((teacher / "config.json").read_text())
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (teacher / "config.json").write_text(json.dumps(cfg))
    write_jsonl(tmp_path / "chats" / "train.jsonl", _long_rows(1000, 400))
    build([str(tmp_path / "chats")], tmp_path / "data", tokenizer=teacher, seq_length=2048)
    paths = _run(tmp_path / "run", tmp_path / "data", teacher, teacher, "stage", "model.seq_length=2048",
                 "model.max_position_embeddings=4096", "post_training.teacher_top_k=32")
    lines: list[str] = []
    meta = run_teacher_stage(paths.root, batch_tokens=16384, log=lines.append)
    print("\n".join(lines[-3:]))
    print(f"teacher stage (1.1B, vocab {vocab}, bf16, {torch.cuda.get_device_name()}): {meta['tokens_scored']} tokens "
          f"in {meta['seconds']:.1f} s = {meta['tokens_per_s']:.0f} tokens/s")
    assert meta["complete"] and meta["tokens_per_s"] > 0

    prefix = str(next((tmp_path / "data").rglob("*.idx")))[:-4]
    reader = ScoreReader(paths.root / "scores" / "teacher", prefixes=[prefix])
    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).cuda().eval()
    from megalaunch.data.index import read_documents

    doc = read_documents(prefix)[3][:2049]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor(doc[None].astype("int64")).cuda()).logits[0].float(), -1)
    ids, values = reader.get(Path(prefix).name, 3)
    want = logp[: len(doc) - 1].gather(-1, torch.from_numpy(ids[1: len(doc)].astype("int64")).cuda()).cpu().numpy()
    err = abs(values[1: len(doc)] - want).max()
    print(f"stored bf16 top-32 log-probabilities vs float32: max |error| {err:.4f}")
    assert err < 0.25  # bf16 weights and activations through 16 layers vs float32 ones
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_tiny_distillation_bf16_stage_and_online(tmp_path: Path) -> None:
    student = make_chat_model(tmp_path / "student", seed=0)
    teacher = make_chat_model(tmp_path / "teacher", seed=7)
    write_jsonl(tmp_path / "chats" / "train.jsonl", chat_rows(64))
    build([str(tmp_path / "chats")], tmp_path / "data", tokenizer=student, seq_length=64)
    hf_to_mcore(student, tmp_path / "converted", model=load_recipe("distill-tiny").recipe.model, vocab_size=512,
                progress=False)
    got = {}
    for mode in ("stage", "online"):
        paths = _run(tmp_path / mode, tmp_path / "data", student, teacher, mode, f"post_training.teacher_mode={mode}",
                     f"checkpoint.load={tmp_path / 'converted'}", "training.train_iters=20",
                     "training.global_batch_size=4", "training.micro_batch_size=2")
        if mode == "stage":
            run_teacher_stage(paths.root, log=print)
            assert read_meta(paths.root / "scores" / "teacher")["complete"]
        log = tmp_path / f"{mode}.jsonl"
        t = Trainer(paths, env={"MEGALAUNCH_LOSS_LOG": str(log)})
        assert t.wait(timeout=600) == [0], t.log()[-4000:]
        got[mode] = losses(log)
        print(mode, [round(got[mode][i], 4) for i in sorted(got[mode])])
    assert sorted(got["stage"]) == sorted(got["online"]) == list(range(1, 21))
    for mode in got:
        assert sum(got[mode][i] for i in range(17, 21)) < 0.8 * sum(got[mode][i] for i in range(1, 5))
    assert all(abs(got["stage"][i] - got["online"][i]) <= 0.05 * abs(got["stage"][i]) + 1e-3 for i in range(1, 21))
