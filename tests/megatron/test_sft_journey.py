"""Fine-tuning in one command, end to end on the CPU (issues 26 and 37): a tiny chat model made and saved
with transformers and a folder of chat JSONL, then `megalaunch submit sft-llama3-1b --from-hf HF --data
CHATS` with only what a CPU and a short test need (the local cluster profile, fp32, sizes): nothing about
the model's shape or the data. The chain's first stage tokenizes the chats with the model's own chat
template and converts the model (its shape from config.json, not the recipe's Llama 3.2 1B), the loss on
the assistant's tokens falls, and its last stage writes RUN/hf, which transformers chats with; its weights
are the trained checkpoint's (converted back to Megatron: every tensor equal). The same run (the first one's
prepared data given to --data) stopped by SIGUSR2 twice resumes exactly (losses equal to 1e-6), and
prompt-side targets carry no loss."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from harness import ledger, losses, run_segment
from tests.support import forkserver
from tests.support.chat import chat_rows, make_chat_model, write_jsonl

from megalaunch.config.loader import load_recipe, load_run_recipe
from megalaunch.finetune.layers import submit_layers
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths

# one worker builds the module fixture (the one-command chain, ~60 s) for all three tests; find_spec, not
# importorskip: importing transformers in every pytest-xdist worker's collection costs ~1 CPU-s
pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.xdist_group("sft-journey"),
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "tokenizers")),
                                 reason="needs transformers and tokenizers")]

ITERS = 24
# What a CPU and a short test add: the machine, fp32, the sizes; sft-tiny's learning rate (tiny random weights).
CPU = ["training.precision=fp32", f"training.train_iters={ITERS}", "training.global_batch_size=8",
       "training.micro_batch_size=4", "training.lr=1e-3", "training.min_lr=1e-3", "training.lr_warmup_iters=2",
       "training.lr_decay_style=constant", "checkpoint.save_interval=4", "checkpoint.keep_last=20",
       "training.log_interval=1", "data.num_workers=0", "chain.hang_timeout_s=120"]


@pytest.fixture(scope="module")
def one_command(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Hugging Face model, the chats, and the one-command run (made once for the module's tests)."""
    root = tmp_path_factory.mktemp("sft")
    hf = make_chat_model(root / "hf")
    write_jsonl(root / "chats" / "train.jsonl", chat_rows(240))
    sets = [*CPU, f"run.root={root / 'runs'}", f"cluster.python={forkserver.python()}", "cluster.env={OMP_NUM_THREADS: '1'}"]
    command = [sys.executable, "-m", "megalaunch.cli.main", "submit", "sft-llama3-1b", "--from-hf", str(hf),
               "--data", str(root / "chats"), "--cluster", "local", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                          env={**os.environ, "MEGALAUNCH_LOSS_LOG": str(root / "straight.jsonl")})
    runs = sorted((root / "runs").glob("sft-llama3-1b-*"))
    assert proc.returncode == 0 and len(runs) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "hf": hf, "run": RunPaths(runs[0]), "out": proc.stdout + proc.stderr,
            "sets": sets, "losses": losses(root / "straight.jsonl")}


def test_one_command_tokenizes_converts_trains_and_exports_a_chat_model(one_command: dict[str, Any]) -> None:
    run, hf, out = one_command["run"], one_command["hf"], one_command["out"]
    assert read_json(run.outcome)["status"] == "finished"
    recipe = load_run_recipe(run)  # the shape came from config.json, not the recipe
    assert (recipe.model.num_layers, recipe.model.hidden_size, recipe.model.seq_length) == (2, 64, 64)
    prepared = ledger(run, "data_prepared")
    assert [(r["ok"], r["source"], r["output"]) for r in prepared] == [(True, str(one_command["root"] / "chats"),
                                                                         str(run.root / "sft_data"))]
    assert [(r["ok"], r["source"]) for r in ledger(run, "converted")] == [(True, str(hf))]
    assert (run.root / "sft_data" / "train.mask").is_file() and run.data_blend.is_file()
    assert read_json(run.manifest)["data_blend_sha256"] == prepared[0]["blend_sha256"]
    exported = ledger(run, "exported")
    assert [(r["ok"], r["iteration"], r["output"]) for r in exported] == [(True, ITERS, str(run.root / "hf"))]
    assert f"Hugging Face model: {run.root / 'hf'}" in out and f"last stage: the final checkpoint as a Hugging " \
        f"Face model -> {run.root / 'hf'}" in out
    status = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "status", str(run.root)],
                            capture_output=True, text=True, timeout=120)
    assert f"Hugging Face model: {run.root / 'hf'} (iteration {ITERS})" in status.stdout, status.stdout

    ref = one_command["losses"]
    assert sorted(ref) == list(range(1, ITERS + 1))
    first, last = sum(ref[i] for i in (1, 2, 3)) / 3, sum(ref[i] for i in range(ITERS - 2, ITERS + 1)) / 3
    assert last < 0.7 * first, (first, last)  # the loss on the assistant's tokens falls

    _chat_with(run.root / "hf")
    _exported_weights_are_the_trained_ones(run, one_command["root"] / "back")


def _chat_with(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and "<|start_header_id|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "red cat sun"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    answer = generated[0, prompt["input_ids"].shape[1]:]
    assert len(answer) > 0 and isinstance(tokenizer.decode(answer), str)


def _weights(directory: Path) -> dict[str, Any]:
    """The model tensors of a torch_dist checkpoint, read without Megatron."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/c.pt")
        state = torch.load(f"{tmp}/c.pt", weights_only=False)
    return {k: v for k, v in state.items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer") and not k.endswith("_extra_state")}


def _exported_weights_are_the_trained_ones(run: RunPaths, back: Path) -> None:
    import torch

    from megalaunch.conversion import hf_to_mcore

    hf_to_mcore(run.root / "hf", back, vocab_size=512, progress=False)
    trained, exported = _weights(run.checkpoints / f"iter_{ITERS:07d}"), _weights(back / "release")
    assert trained.keys() == exported.keys() and len(trained) >= 9
    for name, tensor in trained.items():
        assert torch.equal(tensor, exported[name]), name


def _stopped_chain(one_command: dict[str, Any]) -> RunPaths:
    """The same recipe and settings on the harness's trainer: the first run's prepared data through --data
    (the other kind of SFT_DIR) and its converted model as checkpoint.load (no `job begin` converts here)."""
    run, sets = one_command["run"], CPU
    layers = submit_layers("sft-llama3-1b", sets, from_hf=str(one_command["hf"]), data=str(run.root / "sft_data"))
    model_layer = {**layers[0][1], "checkpoint": {"load": str(run.root / "pretrained")}}
    loaded = load_recipe("sft-llama3-1b", sets, name="chain", cluster="local",
                         layers=[(layers[0][0], model_layer), layers[1]])
    assert loaded.recipe.data.blend[0].path == str(run.root / "sft_data") and not loaded.recipe.data.chat_files
    return write_run(prepare_run(loaded, root=one_command["root"] / "b"))


def test_the_same_run_stopped_twice_resumes_exactly(one_command: dict[str, Any]) -> None:
    chain, log = _stopped_chain(one_command), one_command["root"] / "chain.jsonl"
    stops = []
    for job, stop_after in (("201", 5), ("202", 5), ("203", None)):
        out = run_segment(chain, job, log, stop_after).outcome()
        assert out["status"] == ("finished" if stop_after is None else "saved"), out
        if stop_after is not None:
            stops.append(out["iteration"])
    consumed = [r["consumed_samples"] for r in ledger(chain, "resumed")]
    assert consumed == [8 * s for s in stops]  # global batch 8: consumed conversations continue exactly
    ref, got = one_command["losses"], losses(log)
    assert sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}


def _chat_losses(ckpt: str, model: dict[str, Any], prefix: str, result: Path) -> Any:
    """tests/support/sft_loss.py's losses in a process of its own: forked from the fork server (torch and
    Megatron already imported: ~0.3 CPU-s instead of a fresh spawned interpreter's ~13), or spawned fresh
    with MEGALAUNCH_TEST_FORK=0."""
    import torch
    from tests.support.sft_loss import run_chat_losses

    from megalaunch.runtime.rank.dist_env import free_port

    if not forkserver.enabled():
        return run_chat_losses(ckpt, model, prefix, 64, str(result))
    log = result.with_suffix(".log")
    proc = forkserver.Server.get().call("tests.support.sft_loss:chat_losses",
                                        (0, free_port(), ckpt, model, prefix, 64, str(result)), log=log)
    try:
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    return torch.load(result)


def test_prompt_tokens_carry_no_loss(one_command: dict[str, Any], tmp_path: Path) -> None:
    """Changing only the prompt-side targets leaves the trainer's loss unchanged; changing one of the
    assistant's targets changes it (the real model, dataset and loss function)."""
    run = one_command["run"]
    model = dataclasses.asdict(load_run_recipe(run).model)
    got = _chat_losses(str(run.root / "pretrained" / "release"), model, str(run.root / "sft_data" / "train"),
                       tmp_path / "losses.pt")
    own, prompt_changed, answer_changed = got["losses"]
    assert got["changed_prompt_labels"] > 10 and 0 < int(got["mask"].sum()) < len(got["mask"])
    assert prompt_changed == own
    assert answer_changed != own
