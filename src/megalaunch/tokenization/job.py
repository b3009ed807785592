"""What one dump job runs on a compute node (or the local backend runs on this machine)::

    python -m megalaunch.tokenization.job RUN_DIR [--dump N]

Without --dump, the dump is SLURM_ARRAY_TASK_ID. datatrove's executor runs the dump's tasks
(`workers` at once) and skips those whose completion marker exists, so a relaunch resumes where the
previous job stopped. When every task is complete, the outputs are checked and summary.json written."""

from __future__ import annotations

import argparse
import os
import sys
import time

from megalaunch.rundir.tokenize import TokenizeRun
from megalaunch.tokenization.plan import load_plan
from megalaunch.tokenization.recipe import load_run_recipe


def run_dump(run_dir: str, dump_index: int) -> dict[str, float]:
    """Tokenize one dump (resuming), check its outputs, write its summary; returns the summary."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one worker = one core
    from datatrove.executor import LocalPipelineExecutor

    from megalaunch.tokenization.encoder import check_tokenizer_file
    from megalaunch.tokenization.pipeline import MegatronTokenize, PlanReader

    run = TokenizeRun.at(run_dir)
    recipe = load_run_recipe(run)
    plan = load_plan(run)
    if not 0 <= dump_index < len(plan.dumps):
        raise SystemExit(f"dump {dump_index} does not exist: the plan has dumps 0..{len(plan.dumps) - 1}")
    dump = plan.dumps[dump_index]
    check_tokenizer_file(recipe.tokenizer.path)
    output_dir = run.output_dir(recipe.output_dir)
    n_tasks = len(dump.tasks)
    pipeline = [
        PlanReader([[f.path for f in files] for files in dump.tasks],
                   text_key=recipe.inputs.text_key, id_key=recipe.inputs.id_key),
        MegatronTokenize(output_dir=str(output_dir), output_names=[dump.output_name(t) for t in range(n_tasks)],
                         tokenizer_path=recipe.tokenizer.path, bos=recipe.tokenizer.bos, eos=recipe.tokenizer.eos,
                         add_special_tokens=recipe.tokenizer.add_special_tokens,
                         batch_size=recipe.tokenizer.batch_size,
                         progress_dir=str(run.dump_dir(dump_index) / "progress")),
    ]
    executor = LocalPipelineExecutor(pipeline, tasks=n_tasks, workers=min(recipe.concurrent_workers, n_tasks),
                                     logging_dir=str(run.datatrove_dir(dump_index)), skip_completed=True)
    executor.run()
    return summarize_dump(run, dump_index)


def summarize_dump(run: TokenizeRun, dump_index: int) -> dict[str, float]:
    """Check every output pair of a completed dump and record documents/tokens in summary.json."""
    from megalaunch.data.check import check_prefix, raise_for_problems

    recipe = load_run_recipe(run)
    dump = load_plan(run).dumps[dump_index]
    missing = [t for t in range(len(dump.tasks)) if not run.completion(dump_index, t).exists()]
    if missing:
        raise SystemExit(f"dump {dump_index}: tasks {missing} did not complete")
    output_dir = run.output_dir(recipe.output_dir)
    documents = tokens = 0
    vocab_size = _vocab_size(recipe.tokenizer.path)
    for t in range(len(dump.tasks)):
        report = check_prefix(str(output_dir / dump.output_name(t)), vocab_size=vocab_size)
        raise_for_problems([report])
        documents += report.sequences
        tokens += report.tokens
    summary = {"dump": dump_index, "documents": documents, "tokens": tokens, "tasks": len(dump.tasks),
               "input_bytes": dump.bytes, "finished": time.time()}
    run.write_json(run.summary(dump_index), summary)
    return summary


def _vocab_size(path: str) -> int:
    from tokenizers import Tokenizer

    from megalaunch.tokenization.encoder import check_tokenizer_file

    return int(Tokenizer.from_file(check_tokenizer_file(path)).get_vocab_size(with_added_tokens=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalaunch.tokenization.job")
    parser.add_argument("run_dir")
    parser.add_argument("--dump", type=int, default=None, help="dump index (default: SLURM_ARRAY_TASK_ID)")
    args = parser.parse_args(argv)
    dump = args.dump
    if dump is None:
        if "SLURM_ARRAY_TASK_ID" not in os.environ:
            parser.error("--dump is required outside a Slurm job array")
        dump = int(os.environ["SLURM_ARRAY_TASK_ID"])
    from megalaunch.errors import MegalaunchError

    try:
        summary = run_dump(args.run_dir, dump)
    except MegalaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"dump {dump} done: {summary['documents']} documents, {summary['tokens']} tokens", flush=True)
    return 0


if __name__ == "__main__":  # datatrove's worker pool starts processes with forkserver: keep this guard
    sys.exit(main())
