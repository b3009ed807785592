"""The 1B model's milestone eval on one GPU, end to end and offline: a Llama 3.2 1B shape (16 layers x
2048, GQA; the vocabulary of a tokenizer trained here) trains `--iters` iterations with megalaunch's
local backend on a synthetic corpus it learns fast, the milestone checkpoint is queued by rank 0 and
evaluated by the background eval worker (mcore -> Hugging Face with the project's converter, held-out
perplexity on the validation split, a local multiple-choice task; with --lm-eval also the same task
through lm-eval-harness). Prints and writes OUT/eval_milestone.json: the eval's wall time and its
parts (convert, load, perplexity, task), against the training segment's.

    python bench/eval_milestone.py --out gpu-out/eval [--iters 20] [--lm-eval]

Needs torch + megatron-core (the GPU image) and transformers, tokenizers, safetensors,
huggingface_hub (wheels); --lm-eval also lm-eval, accelerate and their dependencies."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-out/eval"))
    ap.add_argument("--iters", type=int, default=20, help="training iterations = the milestone evaluated")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heldout", type=int, default=16, help="held-out sequences of --seq tokens")
    ap.add_argument("--lm-eval", action="store_true", help="also run the task through lm-eval-harness")
    ap.add_argument("--timeout", type=float, default=480, help="seconds to wait for the eval after training")
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU (checks the script, no GPU)")
    args = ap.parse_args()
    if args.smoke:
        args.seq = 64

    import yaml
    from tests.support.eval_data import make_eval_data

    from megalaunch.rundir.evals import EvalPaths, eval_records
    from megalaunch.rundir.paths import RunPaths

    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    data = make_eval_data(out / "data", n_docs=8000)  # ~650k tokens; 10 % held out
    data_s = time.monotonic() - t0
    eval_section = {"enabled": True, "heldout_sequences": args.heldout, "batch_size": 4,
                    "local_tasks": [{"name": "next_word", "path": str(data.task)}]}
    if args.lm_eval:
        eval_section.update(task_paths=[str(data.lm_eval_tasks)], tasks=["cycle_mc"])
    recipe = {
        "include": ["models/llama3-1b", "training/pretrain", "clusters/local"], "name": "eval1b",
        "run": {"root": str(out / "runs")},
        "cluster": {"gpus_per_node": 1, "tasks_per_node": 1, "cpus_per_task": 8, "time": "00:30:00",
                    "python": sys.executable},
        "model": {"seq_length": args.seq},
        # 8 seqs x 2048 tokens = 16k tokens per step
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": args.iters, "lr_warmup_iters": 2,
                     "log_interval": 5, "eval_iters": 1, "eval_interval": 1000000},
        "checkpoint": {"save_interval": args.iters, "milestone_interval": args.iters, "keep_last": 1},
        "data": {"mock": False, "blend": [{"path": str(data.prefix)}], "split": "90,10,0",
                 "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(data.tokenizer)},
        "eval": eval_section,
    }
    if args.smoke:
        recipe.update(include=["models/tiny", "training/tiny", "clusters/local"], name="evalsmoke",
                      model={"seq_length": args.seq, "max_position_embeddings": args.seq})
        recipe["cluster"].update(gpus_per_node=0, cpus_per_task=1)
        recipe["training"].update(micro_batch_size=8, global_batch_size=8)
    recipe_path = out / "eval1b.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    t0 = time.monotonic()
    chain = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "submit", str(recipe_path)],
                           capture_output=True, text=True)
    train_s = time.monotonic() - t0
    print(chain.stdout[-2000:], chain.stderr[-2000:], sep="\n")
    runs = [p for p in (out / "runs").iterdir() if not p.name.startswith(".")]
    if chain.returncode != 0 or len(runs) != 1:
        print("training failed", file=sys.stderr)
        return 1
    paths = RunPaths(runs[0])
    t0 = time.monotonic()
    record = None
    while time.monotonic() - t0 < args.timeout:
        records = [r for r in eval_records(paths) if r["iteration"] == args.iters]
        if records and records[0]["state"] in ("done", "failed"):
            record = records[0]
            break
        time.sleep(1)
    waited_s = time.monotonic() - t0
    log = paths.evals / "local-worker.log"
    if record is None or record["state"] != "done":
        print(log.read_text()[-4000:] if log.exists() else "no worker log", file=sys.stderr)
        print(f"eval not done: {record}", file=sys.stderr)
        return 1
    results = json.loads(EvalPaths(paths, args.iters).results.read_text())
    summary = {
        "device": results.get("device"), "iteration": args.iters, "seq_length": args.seq,
        "eval_wall_s": results["wall_s"], "eval_timings_s": results.get("timings_s"),
        "heldout": results.get("heldout"), "tasks": results.get("tasks"),
        "data_s": round(data_s, 1), "training_chain_s": round(train_s, 1),
        "eval_after_chain_s": round(waited_s, 1),
        "note": "eval_wall_s: the stage from its start (worker up) to results.json; the worker's Python start-up "
                "(imports) is in eval_after_chain_s",
    }
    (out / "eval_milestone.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
