"""Tokenization throughput: megalaunch's pipeline vs raw `tokenizers.encode_batch`, same data, one run.

    python bench/tokenize.py [--mb 50] [--workdir /tmp/megalaunch-bench] [--repeats 2]

Generates >= --mb MB of text as jsonl (cached in --workdir), trains a 32k byte-level BPE tokenizer
locally, then alternates: raw `encode_batch` over the texts held in memory (the ceiling: no reading,
no writing) and a full megalaunch dump (datatrove executor: read jsonl -> tokenize -> write .bin/.idx,
completion markers) in a fresh worker process, one core each (TOKENIZERS_PARALLELISM=false).
Reports tokens/s per core on CPU time (robust on a shared machine) and on wall time, the best of
--repeats, the ratio, and the peak RSS of the worker process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

from tests.support.corpus import documents, train_bpe_tokenizer, write_jsonl_corpus  # noqa: E402 (after the path)

RAW_BATCH = 1000

_WORKER = r"""
import json, os, resource, sys, time
from megalaunch.tokenization.job import run_dump
t0, c0 = time.perf_counter(), time.process_time()
summary = run_dump(sys.argv[1], 0)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"wall": wall, "cpu": cpu, "tokens": summary["tokens"], "documents": summary["documents"],
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


_DATATROVE = r"""
import json, resource, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer
corpus, tok, out = sys.argv[1:4]
pipeline = [JsonlReader(corpus, glob_pattern="*.jsonl"),
            MegatronDocumentTokenizer(out + "/output", tokenizer_name_or_path=tok, eos_token=None)]
t0, c0 = time.perf_counter(), time.process_time()
stats = LocalPipelineExecutor(pipeline, tasks=1, workers=1, logging_dir=out + "/logs").run()
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
tokens = int(stats.stats[1].stats["tokens"].total)
print(json.dumps({"wall": wall, "cpu": cpu, "tokens": tokens,
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def prepare(workdir: Path, mb: float) -> tuple[Path, Path]:
    corpus = workdir / "corpus"
    marker = corpus / f".complete-{mb}"
    if not marker.exists():
        shutil.rmtree(corpus, ignore_errors=True)
        docs_per_file = 2000
        # ~2.5 kB per document at mean_words=300
        n_files = max(1, int(mb * 1e6 / (docs_per_file * 2450)) + 1)
        write_jsonl_corpus(corpus, n_files=n_files, docs_per_file=docs_per_file, seed=11)
        marker.touch()
    tok = workdir / "tokenizer-32k.json"
    if not tok.exists():
        train_bpe_tokenizer(tok, list(documents(20000, seed=5)), vocab_size=32000)
    return corpus, tok


def load_texts(corpus: Path) -> list[str]:
    texts = []
    for path in sorted(corpus.glob("*.jsonl")):
        with open(path) as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def bench_raw(tok_path: Path, texts: list[str]) -> dict[str, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), RAW_BATCH):
        for enc in tok.encode_batch(texts[i:i + RAW_BATCH]):
            n += len(enc.ids)
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "tokens": n}


def bench_pipeline(workdir: Path, corpus: Path, tok: Path, batch_size: int | None) -> dict[str, float]:
    from megalaunch.config.typed import build
    from megalaunch.tokenization.recipe import TokenizeRecipe
    from megalaunch.tokenization.submit import create_run

    run_dir = workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    tokenizer = {"path": str(tok), "eos": None}
    if batch_size:
        tokenizer["batch_size"] = batch_size
    recipe = build(TokenizeRecipe, {"name": "bench", "inputs": {"roots": [str(corpus)]}, "tokenizer": tokenizer,
                                    "n_dumps": 1, "tasks": 1, "workers": 1, "backend": "local"})
    create_run(recipe, run_dir)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", _WORKER, str(run_dir)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"pipeline failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_datatrove(workdir: Path, corpus: Path, tok: Path) -> dict[str, float]:
    """datatrove's own MegatronDocumentTokenizer at its defaults: the baseline megalaunch improves on."""
    out_dir = workdir / "datatrove"
    shutil.rmtree(out_dir, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _DATATROVE, str(corpus), str(tok), str(out_dir)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"datatrove baseline failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of generated text (default 50)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/megalaunch-bench"))
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best counts")
    parser.add_argument("--no-datatrove", action="store_true",
                        help="skip the datatrove MegatronDocumentTokenizer baseline")
    parser.add_argument("--batch-size", type=int, default=None, help="pipeline batch size (default: recipe's)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    corpus, tok = prepare(args.workdir, args.mb)
    texts = load_texts(corpus)
    mb = sum(len(x.encode()) for x in texts) / 1e6
    print(f"data: {len(texts)} documents, {mb:.1f} MB of text, 32k BPE tokenizer "
          f"(prepared in {time.perf_counter() - t:.0f} s)", flush=True)
    raw_runs, pipe_runs, dt_runs = [], [], []
    for i in range(args.repeats):
        raw_runs.append(bench_raw(tok, texts))
        pipe_runs.append(bench_pipeline(args.workdir, corpus, tok, args.batch_size))
        line = (f"  round {i + 1}: raw {raw_runs[-1]['tokens'] / raw_runs[-1]['cpu'] / 1e6:.3f} M tok/s cpu, "
                f"megalaunch {pipe_runs[-1]['tokens'] / pipe_runs[-1]['cpu'] / 1e6:.3f}")
        if not args.no_datatrove:
            dt_runs.append(bench_datatrove(args.workdir, corpus, tok))
            line += f", datatrove as-is {dt_runs[-1]['tokens'] / dt_runs[-1]['cpu'] / 1e6:.3f}"
        print(line, flush=True)
    if raw_runs[0]["tokens"] != pipe_runs[0]["tokens"]:
        raise SystemExit(f"token counts differ: raw {raw_runs[0]['tokens']} vs pipeline {pipe_runs[0]['tokens']}")
    best = {k: {"cpu": min(r["cpu"] for r in runs), "wall": min(r["wall"] for r in runs)}
            for k, runs in (("raw", raw_runs), ("megalaunch", pipe_runs), ("datatrove", dt_runs)) if runs}
    tokens = raw_runs[0]["tokens"]
    print(f"\n{'':28}{'tok/s/core (cpu)':>18}{'tok/s (wall)':>16}")
    for name, label in (("raw", "raw tokenizers.encode_batch"), ("megalaunch", "megalaunch pipeline"),
                        ("datatrove", "datatrove as-is")):
        if name in best:
            print(f"{label:28}{tokens / best[name]['cpu']:>18,.0f}{tokens / best[name]['wall']:>16,.0f}")
    ratio_cpu = best["raw"]["cpu"] / best["megalaunch"]["cpu"]
    ratio_wall = best["raw"]["wall"] / best["megalaunch"]["wall"]
    print(f"{'megalaunch / raw':28}{ratio_cpu:>17.1%} {ratio_wall:>15.1%}")
    if "datatrove" in best:
        print(f"{'datatrove as-is / raw':28}{best['raw']['cpu'] / best['datatrove']['cpu']:>17.1%} "
              f"{best['raw']['wall'] / best['datatrove']['wall']:>15.1%}")
    rss_mb = max(r["maxrss_kb"] for r in pipe_runs) / 1024
    print(f"\ntokens: {tokens:,} ({mb * 1e6 / tokens:.2f} bytes/token); documents: {len(texts):,}")
    print(f"memory per worker (peak RSS, includes the Python runtime): {rss_mb:.0f} MB "
          f"(bound: 1024 MB) -> {'OK' if rss_mb <= 1024 else 'OVER'}")
    if dt_runs:
        print(f"datatrove as-is peak RSS (its default batch of 10,000 docs): "
              f"{max(r['maxrss_kb'] for r in dt_runs) / 1024:.0f} MB")
    print(f"target megalaunch >= 90% of raw per core: {'MET' if ratio_cpu >= 0.90 else 'NOT MET'} ({ratio_cpu:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
