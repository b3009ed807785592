"""One command for every family (issue #49, item 4): `megalaunch submit sft-tiny --from-hf DIR --data CHATS` on
the local backend, with `chain.export_hf`, for tiny random Qwen3, Qwen3-MoE and Mixtral directories built here
with transformers (config + safetensors + a locally trained tokenizer with a ChatML chat template; no
downloads). The shape comes from config.json; the exported RUN/hf is the original's config (its rms_norm_eps,
generation_config.json) with the trained weights and the chat template, loads in transformers and chats through
`apply_chat_template` + `generate`. The Qwen3-MoE run trains enough to move every kind of weight (attention,
router, experts). Every tokenizer shape users bring works through the same command: no pad token (Llama 3 base
models), pad = eos, special tokens added past the model's rows, a model padded past its tokenizer (Qwen), and a
chat template without a system role (the system message folded into the first user turn, counted). And `convert
hf-to-mcore` without `--recipe` takes each family's shape from config.json."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import ledger, losses
from tests.support import forkserver
from tests.support.chat import CHATML_TEMPLATE, chat_rows, make_chat_tokenizer, write_jsonl

from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths

pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "tokenizers")),
                                 reason="needs transformers and tokenizers")]

VOCAB = 512
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1, rms_norm_eps=1e-6)
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# A Gemma-style template: no system role (it raises on one), turns named by role.
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# What a CPU and a short test add to sft-tiny: the machine, fp32, the sizes (nothing about the model or data).
CPU = ["training.precision=fp32", "training.global_batch_size=4", "training.micro_batch_size=2",
       "training.log_interval=1", "data.num_workers=0", "chain.hang_timeout_s=120"]


def hf_config(family: str, vocab: int) -> Any:
    """Qwen3: head_dim 32 x 4 heads over hidden 64, QK-norm; Qwen3-MoE: the same attention, 4 experts of 32,
    top-2, renormalised (as published); Mixtral: 4 experts of 32, top-2."""
    from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

    base = {**SHAPE, "vocab_size": vocab}
    if family == "qwen3":
        return Qwen3Config(**base, intermediate_size=128, head_dim=32)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**base, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                              num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)
    return MixtralConfig(**base, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def make_model_dir(out: Path, family: str, *, tokenizer: str = "plain", vocab: int = VOCAB) -> Path:
    """A Hugging Face directory as users bring it: random weights (norms around 1), a chat tokenizer of
    `tokenizer`'s shape, the special tokens' ids in config.json and a generation_config.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_chat_tokenizer(out, template=NO_SYSTEM_TEMPLATE if tokenizer == "no-system" else CHATML_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(out)
    if tokenizer == "no-pad":
        tok.pad_token = None
    elif tokenizer == "pad-is-eos":
        tok.pad_token = tok.eos_token
    elif tokenizer == "added-special":
        tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.save_pretrained(out)
    cfg = hf_config(family, vocab)
    cfg.update({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def submit(root: Path, hf: Path, chats: Path, name: str, *sets: str) -> tuple[subprocess.CompletedProcess[str], RunPaths]:
    """`megalaunch submit sft-tiny --from-hf HF --data CHATS --cluster local` as a user runs it."""
    every = [*CPU, *sets, f"run.root={root / 'runs'}", f"cluster.python={forkserver.python()}",
             "cluster.env={OMP_NUM_THREADS: '1'}"]
    command = [sys.executable, "-m", "megalaunch.cli.main", "submit", "sft-tiny", "--name", name, "--from-hf", str(hf),
               "--data", str(chats), "--cluster", "local", *[a for s in every for a in ("--set", s)]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                          env={**os.environ, "MEGALAUNCH_LOSS_LOG": str(root / f"{name}.losses.jsonl")})
    runs = sorted((root / "runs").glob(f"{name}-*"))
    assert len(runs) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, RunPaths(runs[0])


def chat(out: Path) -> str:
    """transformers chats with the exported directory alone: the answer to one user turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "red cat sun"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answer = generated[0, prompt["input_ids"].shape[1]:]
    assert len(answer) > 0
    return str(tokenizer.decode(answer))


def config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    write_jsonl(root / "chats" / "train.jsonl", chat_rows(64))  # a system message in every fourth
    return root


def test_one_command_fine_tunes_a_tiny_qwen3_moe_that_chats_in_transformers(root: Path) -> None:
    """The acceptance test of the one-command path for a mixture of experts: shape from config.json (experts,
    top-k, head_dim, QK-norm), trained 12 iterations, exported into RUN/hf as the original's config and
    generation config with the chat template; transformers chats with it, and every kind of weight moved."""
    import torch
    from safetensors.torch import load_file

    hf = make_model_dir(root / "qwen3_moe", "qwen3_moe")
    proc, run = submit(root, hf, root / "chats", "moe", "training.train_iters=12", "checkpoint.save_interval=6")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_json(run.outcome)["status"] == "finished"
    assert [(r["ok"], r["iteration"]) for r in ledger(run, "exported")] == [(True, 12)]
    recipe = (run.root / "run.yaml").read_text()
    assert "num_experts: 4  # --from-hf" in recipe and "kv_channels: 32  # --from-hf" in recipe
    got = losses(root / "moe.losses.jsonl")
    assert sorted(got) == list(range(1, 13)) and all(v == v for v in got.values())

    out = run.root / "hf"
    before, after = config(hf), config(out)
    assert after["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim", "rms_norm_eps",
                "norm_topk_prob", "vocab_size", "eos_token_id", "bos_token_id", "pad_token_id"):
        assert after.get(key) == before.get(key), key
    assert (out / "generation_config.json").is_file()
    assert (out / "chat_template.jinja").read_text() == (hf / "chat_template.jinja").read_text()
    assert isinstance(chat(out), str)

    original, trained = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == trained.keys()
    for part in ("self_attn.q_proj", "self_attn.q_norm", "mlp.gate.weight", "mlp.experts.0.down_proj", "embed_tokens"):
        names = [n for n in original if part in n]
        assert names and max((trained[n] - original[n]).abs().max().item() for n in names) > 1e-4, part
        assert all(trained[n].shape == original[n].shape for n in names), part
    assert all(torch.isfinite(t).all() for t in trained.values())


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_one_command_for_qwen3_dense_and_mixtral(root: Path, family: str) -> None:
    hf = make_model_dir(root / family, family)
    proc, run = submit(root, hf, root / "chats", family, "training.train_iters=3", "checkpoint.save_interval=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = run.root / "hf"
    cfg = config(out)
    assert cfg["architectures"] == [ARCHITECTURES[family]] and cfg["rms_norm_eps"] == 1e-6
    assert (out / "chat_template.jinja").read_text() == (hf / "chat_template.jinja").read_text()
    assert isinstance(chat(out), str)


# tokenizer shape -> (vocab_size of the model's config.json, what the export's config.json says)
SHAPES = {
    "no-pad": (VOCAB, {"vocab_size": VOCAB, "pad_token_id": None}),
    "pad-is-eos": (VOCAB, {"vocab_size": VOCAB}),
    "added-special": (VOCAB, {"vocab_size": VOCAB + 2}),  # two tokens past the model's rows: the export grows
    "model-past-tokenizer": (VOCAB + 88, {"vocab_size": VOCAB + 88}),  # Qwen's padding: the original's size
    "no-system": (VOCAB, {"vocab_size": VOCAB}),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_tokenizer_shape_trains_and_exports(root: Path, shape: str) -> None:
    """Each tokenizer shape through the one command (a tiny Qwen3): it tokenizes, trains, exports, and the
    export chats in transformers. The template without a system role trains the conversations that have one
    with the system message folded into the first user turn (counted in the data's marker)."""
    from transformers import AutoTokenizer

    vocab, expected = SHAPES[shape]
    hf = make_model_dir(root / shape, "qwen3", tokenizer=shape if shape != "model-past-tokenizer" else "plain",
                        vocab=vocab)
    name = shape.replace("-", "")
    proc, run = submit(root, hf, root / "chats", name, "training.train_iters=3", "checkpoint.save_interval=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    marker = read_json(run.root / "sft_data" / "train.done.json")
    assert marker["conversations"] == 64 and marker["malformed"] == []
    assert marker["folded_system"] == (16 if shape == "no-system" else 0)
    cfg = config(run.root / "hf")
    assert {k: cfg.get(k) for k in expected} == expected
    tokenizer = AutoTokenizer.from_pretrained(run.root / "hf")
    assert len(tokenizer) <= cfg["vocab_size"] and tokenizer.eos_token == "<|im_end|>"
    if shape == "pad-is-eos":
        assert tokenizer.pad_token == tokenizer.eos_token and cfg["pad_token_id"] == cfg["eos_token_id"]
    assert isinstance(chat(run.root / "hf"), str)


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_convert_without_a_recipe_takes_each_family_from_config_json(root: Path, family: str, tmp_path: Path) -> None:
    """`megalaunch convert hf-to-mcore DIR --out OUT` (no --recipe) for each family: the checkpoint's model
    is config.json's, and it converts back to the same weights."""
    import torch
    from safetensors.torch import load_file

    from megalaunch.conversion import mcore_to_hf

    hf = root / family if (root / family / "config.json").is_file() else make_model_dir(root / family, family)
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "convert", "hf-to-mcore", str(hf), "--out",
                           str(tmp_path / "mcore"), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    assert config(tmp_path / "back")["architectures"] == [ARCHITECTURES[family]]
    before, after = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
