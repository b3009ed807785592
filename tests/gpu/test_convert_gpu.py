"""GPU check of conversion (run on the device machine; skipped without CUDA): a ~1.2B Llama (Llama 3.2
1B shapes and rope scaling) built locally with random weights in bf16, converted
HF -> mcore -> HF (bit-exact), and the logits of the Megatron model built from the recipe on the
converted checkpoint compared with the Hugging Face model's in bf16 (TP=1, and TP=2 when two GPUs
are there). Prints the figures for the notes.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_convert_gpu.py -s"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.gpu

CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
              tie_word_embeddings=True, rope_theta=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192})


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama-1b")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    print(f"\nllama: {n / 1e9:.2f} B parameters")
    model.save_pretrained(path / "hf")
    del model
    torch.cuda.empty_cache()
    return path


def test_round_trip_bit_exact(llama_1b: Path) -> None:
    from safetensors.torch import load_file

    from megalaunch.conversion import hf_to_mcore, mcore_to_hf

    t0 = time.perf_counter()
    a = hf_to_mcore(llama_1b / "hf", llama_1b / "mcore", progress=False)
    t1 = time.perf_counter()
    b = mcore_to_hf(llama_1b / "mcore", llama_1b / "back", progress=False)
    t2 = time.perf_counter()
    print(f"\nhf-to-mcore {a.bytes / 1e9:.2f} GB in {t1 - t0:.1f} s ({a.gb_per_s:.2f} GB/s of conversion); "
          f"mcore-to-hf {b.bytes / 1e9:.2f} GB in {t2 - t1:.1f} s ({b.gb_per_s:.2f} GB/s)")
    before, after = {}, {}
    for f in sorted((llama_1b / "hf").glob("*.safetensors")):
        before.update(load_file(f))
    for f in sorted((llama_1b / "back").glob("*.safetensors")):
        after.update(load_file(f))
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype == torch.bfloat16 and torch.equal(after[name], t), name


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_logits_parity(llama_1b: Path, tp: int, tmp_path: Path) -> None:
    if tp > torch.cuda.device_count():
        pytest.skip(f"TP={tp} needs {tp} GPUs")
    from tests.support.hf_models import run_megatron_logits
    from transformers import AutoModelForCausalLM

    from megalaunch.conversion import hf_to_mcore
    from megalaunch.conversion.families import model_from_hf_config

    if not (llama_1b / "mcore").exists():
        hf_to_mcore(llama_1b / "hf", llama_1b / "mcore", progress=False)
    model = model_from_hf_config(json.loads((llama_1b / "hf" / "config.json").read_text()))
    tokens = torch.randint(0, model.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.tensor(tokens, device="cuda")
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(llama_1b / "hf", dtype=torch.bfloat16).cuda().eval()
        ref_bf16 = hf(ids).logits.float().cpu()
        del hf
        hf32 = AutoModelForCausalLM.from_pretrained(llama_1b / "hf", dtype=torch.float32).cuda().eval()
        ref_fp32 = hf32(ids).logits.float().cpu()
        del hf32
    torch.cuda.empty_cache()
    got = run_megatron_logits(tp, str(llama_1b / "mcore" / "release"), dataclasses.asdict(model.model),
                              model.vocab_size, tokens, str(tmp_path / "logits.pt"), dtype="bfloat16")
    noise = (ref_bf16 - ref_fp32).abs().max().item()  # what bf16 alone costs (Hugging Face vs itself)
    diff = (got - ref_bf16).abs().max().item()
    diff32 = (got - ref_fp32).abs().max().item()
    agree = (got.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item()
    agree_hf = (ref_bf16.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item()
    print(f"\nTP={tp}: max|megatron_bf16 - hf_bf16| = {diff:.4f}, max|megatron_bf16 - hf_fp32| = {diff32:.4f}, "
          f"bf16 noise max|hf_bf16 - hf_fp32| = {noise:.4f}, logits scale {ref_fp32.abs().max().item():.2f}; "
          f"argmax agreement with fp32: megatron {agree:.4f}, hf bf16 {agree_hf:.4f}")
    # The conversion adds no error of its own: Megatron in bf16 is as close to the fp32 reference as
    # Hugging Face in bf16 is (within a factor of 2 for kernel differences).
    assert diff32 <= 2 * noise + 1e-2
    assert agree >= agree_hf - 0.02
