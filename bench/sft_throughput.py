"""SFT beside pre-training of the same shape on one GPU: tokens/s and MFU (issue 26).

    PYTHONPATH=src python bench/sft_throughput.py [--out DIR] [--iters 30] [--shape 1b]

1. A Hugging Face-shaped Llama 3.2 1B checkpoint (config.json + safetensors, random bf16 weights) is
   written with megalaunch's own safetensors writer and config (no transformers needed), then
   converted with `hf_to_mcore`: what `convert hf-to-mcore` does with a downloaded model.
2. Chat data in the format `megalaunch data sft` writes (.bin/.idx + .mask), generated without a
   tokenizer: conversations of 256-2048 tokens (mean ~1150), the answer's share of each masked in.
3. Pre-training (`train/llama3-1b`, mock data, from scratch) and SFT (`train/sft-llama3-1b` from the
   converted checkpoint, data.format chat) with the same sequence length, batch and kernels, one after
   the other, each stopped once `--iters` iterations are logged. Tokens/s and TFLOP/s per GPU come from
   Megatron's log (averaged after the warm-up intervals); MFU = TFLOP/s / the GPU's dense bf16 peak.
   SFT also reports real tokens/s (sequence slots minus padding) and trained tokens/s (under the mask).
Results: a table on stdout and OUT/sft_throughput.json. `--shape tiny --allow-cpu` smoke-tests it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).resolve().parent))]
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
_spec = importlib.util.spec_from_file_location("train_overhead", REPO / "bench" / "train_overhead.py")
assert _spec is not None and _spec.loader is not None
overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overhead)

PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "B200": 2250.0}  # dense bf16
SHAPES = {
    "1b": {"pretrain": "train/llama3-1b", "sft": "train/sft-llama3-1b", "vocab": 128256, "seq": 2048,
           "sets": [*overhead.DEFAULT_SETS]},
    "tiny": {"pretrain": "train/tiny", "sft": "train/sft-tiny", "vocab": 512, "seq": 64,
             "sets": ["cluster.backend=local", "training.micro_batch_size=2", "training.global_batch_size=4",
                      "training.log_interval=2", "megatron_args.log-throughput=true", "chain.hang_timeout_s=300"]},
}


def hf_checkpoint(out: Path, model: Any, vocab: int, dtype: str) -> Path:
    """config.json + model.safetensors of a random Llama of `model`'s shape (Hugging Face's names)."""
    import torch

    from megalaunch.conversion.checkpoint_io.safetensors_io import SafetensorsWriter, dtype_code
    from megalaunch.conversion.families import hf_config_from_model

    cfg = hf_config_from_model(model, family="llama", vocab_size=vocab, dtype=dtype)
    h, f, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * (h // heads)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    torch_dtype = getattr(torch, dtype)
    writer = SafetensorsWriter(out, [(n, dtype_code(torch_dtype), s) for n, s in shapes.items()])
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        writer.write(name, t.to(torch_dtype))
    writer.close()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def chat_data(prefix: Path, vocab: int, conversations: int, max_len: int) -> dict[str, int]:
    """Random conversations in `megalaunch data sft`'s format: the last ~40 % of each is the answer."""
    import numpy as np

    from megalaunch.data.writer import IndexedWriter, token_dtype_for_vocab

    rng = np.random.default_rng(0)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype_for_vocab(vocab))
    lengths = rng.integers(max_len // 8, max_len + 1, size=conversations)
    masks = []
    for n in lengths:
        writer.add_batch([rng.integers(0, vocab, size=int(n)).tolist()])
        mask = np.zeros(int(n), dtype=np.uint8)
        mask[int(n * 0.6):] = 1
        masks.append(mask)
    writer.close()
    np.concatenate(masks).tofile(str(prefix) + ".mask")
    real = int(np.minimum(lengths, max_len + 1).sum())
    return {"conversations": conversations, "tokens": int(lengths.sum()), "mean_length": int(lengths.mean()),
            "trained": int(sum(m[: max_len + 1].sum() for m in masks)), "real_in_window": real}


def run_one(out: Path, kind: str, recipe: str, sets: list[str], iters: int, job: str) -> dict[str, float]:
    run = overhead.make_run(out / "runs", recipe, sets, name=f"{kind}-{job}")
    log = out / f"{kind}.log"
    p = overhead.start(run, job, bare=False, log=log)
    while not any(int(m.group(1)) >= iters for m in overhead.ITER_RE.finditer(log.read_text(errors="replace"))):
        if p.poll() is not None:
            raise RuntimeError(f"{kind} run ended early, see {log}")
        time.sleep(0.5)
    p.kill()
    p.wait()
    return overhead.iteration_stats(log.read_text(errors="replace"), warmup_intervals=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "sft")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    parser.add_argument("--set", action="append", default=[], help="extra recipe overrides (both runs)")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test without a GPU (--shape tiny)")
    a = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu --shape tiny for a smoke test)", file=sys.stderr)
        return 2
    from megalaunch.config.loader import load_recipe
    from megalaunch.conversion import hf_to_mcore

    shape, out = SHAPES[a.shape], a.out
    out.mkdir(parents=True, exist_ok=True)
    common = [*shape["sets"], f"model.seq_length={shape['seq']}", f"training.attention={a.attention}",
              "training.train_iters=100000", "checkpoint.save_interval=1000000", *a.set]
    model = load_recipe(shape["sft"], common, cluster="local").recipe.model  # the shape both runs train
    t0 = time.monotonic()
    hf = hf_checkpoint(out / "hf", model, shape["vocab"], "bfloat16" if torch.cuda.is_available() else "float32")
    hf_to_mcore(hf, out / "converted", model=model, vocab_size=shape["vocab"], progress=False, overwrite=True)
    data = chat_data(out / "chat" / "train", shape["vocab"], 4000 if a.shape == "1b" else 200, shape["seq"])
    prep_s = time.monotonic() - t0
    print(f"checkpoint made and converted, data written: {prep_s:.0f} s; {data}", flush=True)
    sft_sets = ["data.mock=false", f"data.blend=[{{path: {out / 'chat'}}}]", "data.format=chat",
                f"checkpoint.load={out / 'converted'}"]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "shape": a.shape, "seq_length": shape["seq"], "data": data, "prepare_s": prep_s}
    results["pretrain"] = run_one(out, "pretrain", shape["pretrain"], common, a.iters, "301")
    results["sft"] = run_one(out, "sft", shape["sft"], [*common, *sft_sets], a.iters, "302")
    report(results, common)
    (out / "sft_throughput.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def report(r: dict[str, Any], sets: list[str]) -> None:
    gbs = int(next(s for s in sets[::-1] if s.startswith("training.global_batch_size=")).split("=")[1])
    slots = gbs * r["seq_length"]
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in r["device"]), None)
    data = r["data"]
    real_share = data["real_in_window"] / (data["conversations"] * (r["seq_length"] + 1))
    trained_share = data["trained"] / (data["conversations"] * (r["seq_length"] + 1))
    print(f"\n== SFT beside pre-training, {r['shape']} at {r['seq_length']} tokens, on {r['device']} ==")
    for kind in ("pretrain", "sft"):
        k = r[kind]
        k["tokens_per_s"] = slots / k["ms_per_iteration"] * 1000
        k["mfu"] = k["tflops_per_gpu"] / peak if peak else None
        extra = (f"  real {k['tokens_per_s'] * real_share:8.0f} tokens/s, trained {k['tokens_per_s'] * trained_share:8.0f}"
                 " tokens/s" if kind == "sft" else "")
        mfu = f"{k['mfu']:.1%}" if k["mfu"] is not None else "n/a"
        print(f"{kind:9s} {k['tokens_per_s']:9.0f} tokens/s  {k['tflops_per_gpu']:6.1f} TFLOP/s/GPU  MFU {mfu:>6s}  "
              f"{k['ms_per_iteration']:7.1f} ms/iteration{extra}")
    print("tokens/s counts sequence slots (Megatron computes the FLOPs of the whole padded sequence); one "
          "conversation per sequence pads each to the sequence length")


if __name__ == "__main__":
    sys.exit(main())
