"""`megalaunch submit sft-tiny --from-hf DIR` on the local backend, the way a user runs it: the chain's
first stage converts the Hugging Face model into RUN/pretrained (ledger `converted`), the first segment
trains from it (with lr ~ 0 the weights converted back equal the Hugging Face model's), and weights that
do not fit their config.json (the shape the run takes) stop the chain before training with the
conversion's one-line reason."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import forkserver
from tests.support.chat import chat_rows, make_chat_model, write_jsonl

from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths

# torch, transformers and the converter are imported by the test, not at collection (find_spec, not
# importorskip: these imports would cost every pytest-xdist worker's collection ~3 CPU-s)
pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "tokenizers")),
                                 reason="needs transformers and tokenizers")]


def _submit(tmp: Path, hf: Path, data: Path, name: str) -> tuple[subprocess.CompletedProcess[str], RunPaths]:
    sets = ["training.train_iters=2", "checkpoint.save_interval=2", "training.lr=1e-12", "training.min_lr=1e-12",
            "training.lr_warmup_iters=0", "training.global_batch_size=2", "training.micro_batch_size=2",
            # no last stage: the weights are converted back here, in this process (test_sft_journey.py tests
            # the export), not by a fresh `convert mcore-to-hf` process (~10 CPU-s)
            "chain.export_hf=false",
            "data.mock=false", f"data.blend=[{{path: {data}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={hf}", f"run.root={tmp / 'runs'}", f"cluster.python={forkserver.python()}",
            "cluster.env={OMP_NUM_THREADS: '1'}"]
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "submit", "sft-tiny", "--name", name,
                           "--from-hf", str(hf), *args], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    runs = sorted((tmp / "runs").glob(f"{name}-*"))
    assert runs, proc.stdout + proc.stderr
    return proc, RunPaths(runs[0])


@pytest.mark.timeout(900)
def test_from_hf_converts_as_the_first_stage_and_trains_from_it(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from megalaunch.conversion import mcore_to_hf
    from megalaunch.tokenization.chat.build import build

    hf = make_chat_model(tmp_path / "hf")
    write_jsonl(tmp_path / "chats" / "c.jsonl", chat_rows(16))
    build([str(tmp_path / "chats")], tmp_path / "data", tokenizer=hf)
    proc, paths = _submit(tmp_path, hf, tmp_path / "data", "fromhf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    converted = [r for r in read_jsonl(paths.ledger) if r["event"] == "converted"]
    assert [(r["ok"], r["source"]) for r in converted] == [(True, str(hf))]
    assert (paths.root / "pretrained" / "latest_checkpointed_iteration.txt").is_file()
    assert read_json(paths.outcome)["status"] == "finished"
    mcore_to_hf(paths.root, tmp_path / "back", progress=False)
    before, after = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():  # lr ~ 0: what training saved is what it started from
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0, msg=name)

    cfg = json.loads((hf / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    for f in hf.iterdir():
        (tmp_path / "wide" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    proc, paths = _submit(tmp_path, tmp_path / "wide", tmp_path / "data", "wide")  # the shape is config.json's,
    stopped = [r for r in read_jsonl(paths.ledger) if r["event"] == "chain_stopped"]  # the weights are not
    assert len(stopped) == 1 and "converting checkpoint.from_hf" in stopped[0]["reason"], stopped
    assert "shape" in stopped[0]["reason"] and "256" in stopped[0]["reason"] and "\n" not in stopped[0]["reason"]
    assert not paths.checkpoints.is_dir() or not any(paths.checkpoints.iterdir())  # nothing trained
