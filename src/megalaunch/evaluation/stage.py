"""One eval stage, in this process: wait for the checkpoint to be complete, convert it to Hugging
Face (conversion.mcore_to_hf), held-out perplexity, the tasks, results.json, the chain's W&B run.
What the Slurm job (`megalaunch eval job RUN --iteration N`) and the local backend run."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError
from megalaunch.rundir.evals import EvalPaths
from megalaunch.rundir.files import append_jsonl, atomic_write_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import one_line

POLL_S = 2.0


def job_label() -> str:
    return os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"


def select_tasks(recipe: Recipe, names: list[str] | None) -> tuple[list[Any], list[str]]:
    """(local tasks, lm-eval task names) to run: the recipe's, or those `names` pick (a name that is
    not one of the recipe's local tasks is an lm-eval task name)."""
    local = {t.name: t for t in recipe.eval.local_tasks}
    if names is None:
        return list(local.values()), list(recipe.eval.tasks)
    return [local[n] for n in names if n in local], [n for n in names if n not in local]


def wait_complete(paths: RunPaths, iteration: int, timeout_s: float) -> None:
    from megalaunch.runtime.checkpoint.resume import incomplete_reason, iter_dir

    deadline = time.monotonic() + timeout_s
    while True:
        directory = iter_dir(paths, iteration)
        tracker = paths.read_tracker()
        reason = incomplete_reason(directory) if directory.is_dir() else "missing"
        if reason is None and tracker is not None and tracker >= iteration:
            return
        if time.monotonic() >= deadline:
            raise MegalaunchError(f"checkpoint {iteration} is not complete after {timeout_s:.0f} s ({reason}; "
                                  f"tracker at {tracker})", field="--iteration",
                                  fix=f"megalaunch eval {paths.root} --iteration N with a complete checkpoint")
        time.sleep(POLL_S)


def run_stage(paths: RunPaths, iteration: int, *, tasks: list[str] | None = None,
              log: Any = print) -> dict[str, Any]:
    """Evaluate `iteration`; writes results.json and the state; raises (state failed) on error."""
    from megalaunch.config.loader import load_run_recipe

    ep = EvalPaths(paths, iteration)
    job = job_label()
    ep.write_state("running", job_id=job, host=socket.gethostname(), pid=os.getpid())
    _ledger(paths, "eval_started", iteration, job)
    start = time.monotonic()
    recipe = load_run_recipe(paths)
    try:
        results = _evaluate(paths, recipe, ep, iteration, tasks, log)
    except BaseException as e:
        reason = one_line(e)
        ep.write_state("failed", job_id=job, reason=reason)
        _ledger(paths, "eval_failed", iteration, job, reason=reason)
        if not recipe.eval.keep_hf:
            shutil.rmtree(ep.hf, ignore_errors=True)
        raise
    results.update(iteration=iteration, job_id=job, wall_s=round(time.monotonic() - start, 3), time=time.time())
    atomic_write_json(ep.results, results)
    if not recipe.eval.keep_hf:  # before `done`: a reader of the state finds the conversion gone (a CI race)
        shutil.rmtree(ep.hf, ignore_errors=True)
    ep.write_state("done", job_id=job, reason=None)
    _ledger(paths, "eval_done", iteration, job, heldout_ppl=(results.get("heldout") or {}).get("ppl"))
    _log_wandb(paths, recipe, results, log)
    return results


def _evaluate(paths: RunPaths, recipe: Recipe, ep: EvalPaths, iteration: int, names: list[str] | None,
              log: Any) -> dict[str, Any]:
    ev = recipe.eval
    local_tasks, lm_tasks = select_tasks(recipe, names)
    questions = {t.name: _read_task(t) for t in local_tasks}  # a malformed task fails before the conversion
    wait_complete(paths, iteration, ev.wait_complete_s)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    from megalaunch.conversion import mcore_to_hf

    if ep.hf.exists():
        shutil.rmtree(ep.hf)  # a previous attempt's (maybe partial) output
    mcore_to_hf(paths.root, ep.hf, iteration=iteration, progress=False)
    timings["convert_s"] = time.monotonic() - t0
    log(f"eval {iteration}: converted to {ep.hf} in {timings['convert_s']:.1f} s")

    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available() and ev.gpus != 0
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.monotonic()
    model: Any = AutoModelForCausalLM.from_pretrained(ep.hf, dtype=dtype)
    model = model.to(device).eval()
    timings["load_s"] = time.monotonic() - t0
    out: dict[str, Any] = {"tokens": iteration * recipe.training.global_batch_size * recipe.model.seq_length,
                           "device": torch.cuda.get_device_name() if cuda else "cpu", "tasks": {}}
    if ev.heldout_sequences > 0:
        t0 = time.monotonic()
        out["heldout"] = _heldout(paths, recipe, model, device)
        timings["heldout_s"] = time.monotonic() - t0
        log(f"eval {iteration}: held-out ppl {out['heldout']['ppl']:.4f} over {out['heldout']['tokens']} tokens")
    if questions:
        from transformers import AutoTokenizer

        from megalaunch.evaluation.tasks import run_local_task

        tokenizer = AutoTokenizer.from_pretrained(ep.hf)
        for name, qs in questions.items():
            t0 = time.monotonic()
            out["tasks"][name] = run_local_task(model, tokenizer, qs, device=device)
            timings[f"{name}_s"] = time.monotonic() - t0
            log(f"eval {iteration}: {name} acc {out['tasks'][name]['acc']:.3f}")
    if lm_tasks:
        from megalaunch.evaluation.tasks import run_lm_eval

        del model
        t0 = time.monotonic()
        out["tasks"].update(run_lm_eval(ep.hf, lm_tasks, task_paths=list(ev.task_paths), batch_size=ev.batch_size,
                                        device=str(device), dtype="bfloat16" if cuda else "float32"))
        timings["lm_eval_s"] = time.monotonic() - t0
    out["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    return out


def _read_task(task: Any) -> list[dict[str, Any]]:
    from megalaunch.evaluation.tasks import read_local_task

    return read_local_task(task.name, task.path)


def _heldout(paths: RunPaths, recipe: Recipe, model: Any, device: Any) -> dict[str, Any]:
    from megalaunch.evaluation.heldout import blend_prefixes, heldout_sequences, perplexity

    ev = recipe.eval
    if ev.heldout_blend:
        prefixes, split, source = list(ev.heldout_blend), None, "eval.heldout_blend"
    else:
        prefixes, split = blend_prefixes(paths.data_blend.read_text()), recipe.data.split
        source = f"validation split {split} of data_blend.txt"
    seqs = heldout_sequences(prefixes, split=split, count=ev.heldout_sequences, seq_length=recipe.model.seq_length)
    return {**perplexity(model, seqs, batch_size=ev.batch_size, device=device), "source": source}


def _log_wandb(paths: RunPaths, recipe: Recipe, results: dict[str, Any], log: Any) -> None:
    """Into the chain's W&B run (its id in state/wandb.json), on eval axes of its own (eval/iteration,
    eval/tokens), so the training steps are never touched. Never fails the eval."""
    if not recipe.logging.wandb_project:
        return
    try:
        from megalaunch.runtime.observation.wandb_run import log_eval

        run_id = log_eval(paths, metrics=eval_metrics(results), project=recipe.logging.wandb_project,
                          entity=recipe.logging.wandb_entity, mode=recipe.logging.wandb_mode)
        log(f"eval {results['iteration']}: logged to W&B run {run_id}")
    except Exception as e:
        log(f"eval {results['iteration']}: W&B logging failed: {one_line(e)}")


def eval_metrics(results: dict[str, Any]) -> dict[str, Any]:
    """results.json -> W&B keys: eval/iteration, eval/tokens, eval/heldout_ppl, eval/<task>/<metric>."""
    out: dict[str, Any] = {"eval/iteration": results["iteration"], "eval/tokens": results.get("tokens")}
    heldout = results.get("heldout") or {}
    if heldout:
        out["eval/heldout_ppl"] = heldout.get("ppl")
        out["eval/heldout_nll"] = heldout.get("nll")
    for task, metrics in (results.get("tasks") or {}).items():
        out.update({f"eval/{task}/{k}": v for k, v in metrics.items() if isinstance(v, int | float)})
    return out


def _ledger(paths: RunPaths, event: str, iteration: int, job: str, **data: Any) -> None:
    # `eval_job`, not `job_id`: the ledger's job ids are the chain's segments
    append_jsonl(paths.ledger, {"event": event, "time": time.time(), "eval_job": job, "iteration": iteration, **data})


def hf_dir(paths: RunPaths, iteration: int) -> Path:
    return EvalPaths(paths, iteration).hf
