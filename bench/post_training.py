"""DPO beside SFT on one GPU, same model, sequence length and tokens per step, and the reference stage's
throughput (issue 51).

    PYTHONPATH=src python bench/post_training.py [--out DIR] [--iters 20] [--pairs 1000] [--shape 1b]

1. A Llama 3.2 1B-shaped Hugging Face checkpoint (random bf16 weights, bench/sft_throughput.py's writer),
   converted with `hf_to_mcore`.
2. A synthetic preference set in `megalaunch data sft`'s format (no tokenizer): `--pairs` pairs, each a prompt
   of 64-1024 random tokens and two different answers of 64-1024 tokens (chosen, then rejected; the loss mask
   on the answers), capped at the sequence length.
3. SFT (`train/sft-llama3-1b`) on those documents as conversations, and DPO (`train/dpo-llama3-1b`, beta 0.1)
   on them as pairs, from the converted checkpoint: micro-batch 4 sequences (SFT 4 conversations, DPO 2
   pairs), global batch 64 sequences (DPO 32 pairs; DPO's batch sizes count sequences), so both process the
   same sequence slots per step. Each run
   is stopped once `--iters` iterations are logged; ms per iteration from Megatron's log after the warm-up.
   tokens/s = sequences per step x sequence length / time per step (sequence slots, padding included, as
   Megatron counts FLOPs; Megatron's own TFLOP/s for DPO counts one sequence per sample, a pair holds two, so
   DPO's TFLOP/s is printed doubled).
   With `--online`, a third run: DPO with the reference online (a frozen copy of the starting model in the job,
   one more forward per micro-batch, no stage).
4. The reference stage: DPO's first segment scores every document with the starting model before iteration 1
   (RUN/scores/reference); its tokens/s and seconds come from the ledger's `reference_scored` (real tokens:
   each document up to the sequence length, no padding).
Results: a table on stdout and OUT/post_training.json. `--shape tiny --allow-cpu` smoke-tests it."""

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
_spec = importlib.util.spec_from_file_location("sft_throughput", REPO / "bench" / "sft_throughput.py")
assert _spec is not None and _spec.loader is not None
sft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sft)

SHAPES = {
    "1b": {"sft": "train/sft-llama3-1b", "dpo": "train/dpo-llama3-1b", "vocab": 128256, "seq": 2048,
           "sets": [*sft.overhead.DEFAULT_SETS], "mb": 4, "gbs": 64},
    "tiny": {"sft": "train/sft-tiny", "dpo": "train/dpo-tiny", "vocab": 512, "seq": 64, "mb": 4, "gbs": 8,
             "sets": ["cluster.backend=local", "training.log_interval=2", "megatron_args.log-throughput=true",
                      "chain.hang_timeout_s=300"]},
}


def pair_data(prefix: Path, vocab: int, pairs: int, seq: int) -> dict[str, int]:
    """Random preference pairs as `megalaunch data sft` writes them: chosen then rejected, answers masked."""
    import numpy as np

    from megalaunch.data.writer import IndexedWriter, token_dtype_for_vocab

    rng = np.random.default_rng(0)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedWriter(prefix, token_dtype_for_vocab(vocab))
    masks, lengths = [], []
    low, high = max(2, seq // 32), max(3, seq // 2)
    for _ in range(pairs):
        prompt = rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist()
        for _side in range(2):
            answer = rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist()
            doc = (prompt + answer)[: seq + 1]
            writer.add_batch([doc])
            mask = np.zeros(len(doc), dtype=np.uint8)
            mask[min(len(prompt), len(doc)):] = 1
            masks.append(mask)
            lengths.append(len(doc))
    writer.close()
    np.concatenate(masks).tofile(str(prefix) + ".mask")
    return {"pairs": pairs, "documents": 2 * pairs, "tokens": int(sum(lengths)), "mean_length": int(np.mean(lengths))}


def reference_stage(out: Path) -> dict[str, Any]:
    """The ledger's `reference_scored` of the DPO run (under OUT/runs)."""
    for ledger in sorted((out / "runs").glob("dpo-*/state/ledger.jsonl")):
        for line in ledger.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "reference_scored":
                return {"seconds": event["seconds"], "tokens_per_s": event["tokens_per_s"],
                        "documents": event["documents"]}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "post_training")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    parser.add_argument("--set", action="append", default=[], help="extra recipe overrides (both runs)")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test without a GPU (--shape tiny)")
    parser.add_argument("--online", action="store_true", help="also DPO with the reference online (a frozen copy)")
    a = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu --shape tiny for a smoke test)", file=sys.stderr)
        return 2
    from megalaunch.config.loader import load_recipe
    from megalaunch.conversion import hf_to_mcore

    shape, out = SHAPES[a.shape], a.out
    out.mkdir(parents=True, exist_ok=True)
    seq, mb, gbs = shape["seq"], shape["mb"], shape["gbs"]
    common = [*shape["sets"], f"model.seq_length={seq}", f"training.attention={a.attention}",
              "training.train_iters=100000", "checkpoint.save_interval=1000000", "chain.export_hf=false", *a.set]
    model = load_recipe(shape["sft"], common, cluster="local").recipe.model
    t0 = time.monotonic()
    hf = sft.hf_checkpoint(out / "hf", model, shape["vocab"], "bfloat16" if torch.cuda.is_available() else "float32")
    hf_to_mcore(hf, out / "converted", model=model, vocab_size=shape["vocab"], progress=False, overwrite=True)
    data = pair_data(out / "pairs" / "train", shape["vocab"], a.pairs, seq)
    prep_s = time.monotonic() - t0
    print(f"checkpoint made and converted, pairs written: {prep_s:.0f} s; {data}", flush=True)
    data_sets = ["data.mock=false", f"data.blend=[{{path: {out / 'pairs'}}}]", "data.format=chat",
                 f"checkpoint.load={out / 'converted'}"]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "shape": a.shape, "seq_length": seq, "sequences_per_step": gbs, "data": data,
                               "prepare_s": prep_s}
    results["sft"] = sft.run_one(out, "sft", shape["sft"], [
        *common, *data_sets, f"training.micro_batch_size={mb}", f"training.global_batch_size={gbs}"], a.iters, "401")
    # DPO's batch sizes count sequences too (a pair is two): the same slots per micro-batch and per step
    dpo_sets = [*common, *data_sets, f"training.micro_batch_size={mb}", f"training.global_batch_size={gbs}"]
    results["dpo"] = sft.run_one(out, "dpo", shape["dpo"], [*dpo_sets, "post_training.reference=stage"], a.iters, "402")
    results["reference_stage"] = reference_stage(out)
    kinds = ["sft", "dpo"]
    if a.online:  # the reference as a frozen copy in the job: one more forward per micro-batch, no stage
        results["dpo_online"] = sft.run_one(out, "dpo_online", shape["dpo"], [*dpo_sets, "post_training.reference=online"],
                                            a.iters, "403")
        kinds.append("dpo_online")
    for kind in kinds[1:]:
        results[kind]["tflops_per_gpu"] *= 2  # Megatron counts one sequence per sample; a DPO sample is a pair
    for kind in kinds:
        results[kind]["tokens_per_s"] = gbs * seq / results[kind]["ms_per_iteration"] * 1000
    print(f"\n== DPO beside SFT, {a.shape} at {seq} tokens, {gbs} sequences per step, on {results['device']} ==")
    for kind in kinds:
        k = results[kind]
        print(f"{kind:10s} {k['tokens_per_s']:9.0f} tokens/s  {k['tflops_per_gpu']:6.1f} TFLOP/s/GPU  "
              f"{k['ms_per_iteration']:7.1f} ms/iteration")
    ref = results["reference_stage"]
    if ref:
        print(f"reference stage: {ref['tokens_per_s']:9.0f} tokens/s (real tokens, forward only), {ref['seconds']:.1f} s "
              f"for {sum(ref['documents'].values())} documents")
    print(f"DPO / SFT tokens/s: {results['dpo']['tokens_per_s'] / results['sft']['tokens_per_s']:.3f}")
    (out / "post_training.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
