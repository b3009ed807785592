"""Tasks: megalaunch's own multiple-choice runner over a local JSON-lines file, and lm-eval-harness
(the [eval] extra) for task names and task YAML directories. Nothing is downloaded: jobs run with
Hugging Face's offline switches on; a task whose data is not local fails with lm-eval's own error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megalaunch.errors import MegalaunchError

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class EvalTaskError(MegalaunchError):
    """A task cannot run: its file is malformed, its name unknown, its data not local."""


def read_local_task(name: str, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The questions of a local task, each checked: {"context": str, "choices": [str, ...], "answer": int}."""
    fix = f"fix {path}: one JSON object a line with context (text), choices (>= 2 texts), answer (index)"
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EvalTaskError(f"task {name}: cannot read {path}: {e}", field="eval.local_tasks", fix=fix) from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalTaskError(f"task {name}: {path} line {n} is not JSON ({e.msg})", field="eval.local_tasks",
                                fix=fix) from None
        ok = (isinstance(q, dict) and isinstance(q.get("context"), str) and isinstance(q.get("choices"), list)
              and len(q["choices"]) >= 2 and all(isinstance(c, str) and c for c in q["choices"]))
        if not ok:
            raise EvalTaskError(f"task {name}: {path} line {n} lacks context, choices (>= 2 texts) or answer",
                                field="eval.local_tasks", fix=fix)
        answer = q.get("answer")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(q["choices"]):
            raise EvalTaskError(f"task {name}: {path} line {n}: answer {answer!r} is not an index of its "
                                f"{len(q['choices'])} choices (0..{len(q['choices']) - 1})",
                                field="eval.local_tasks", fix=fix)
        out.append(q)
    if not out:
        raise EvalTaskError(f"task {name}: {path} holds no questions", field="eval.local_tasks", fix=fix)
    return out


def run_local_task(model: Any, tokenizer: Any, questions: list[dict[str, Any]], *, device: Any) -> dict[str, Any]:
    """Accuracy: the choice with the highest summed log-likelihood after the context wins (and its
    length-normalised variant, acc_norm, per token)."""
    import torch

    correct = correct_norm = 0
    with torch.no_grad():
        for q in questions:
            ctx = tokenizer(q["context"], add_special_tokens=False)["input_ids"]
            scores, norms = [], []
            for choice in q["choices"]:
                cont = tokenizer(choice, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([ctx + cont], dtype=torch.long, device=device)
                logp = torch.log_softmax(model(ids).logits.float()[0, :-1], dim=-1)
                targets = ids[0, 1:]
                picked = logp.gather(1, targets[:, None])[:, 0][len(ctx) - 1:] if ctx else logp.gather(
                    1, targets[:, None])[:, 0]
                scores.append(float(picked.sum()))
                norms.append(float(picked.sum()) / max(1, len(cont)))
            correct += int(max(range(len(scores)), key=scores.__getitem__) == q["answer"])
            correct_norm += int(max(range(len(norms)), key=norms.__getitem__) == q["answer"])
    n = len(questions)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "runner": "megalaunch"}


def run_lm_eval(hf_dir: Path, tasks: list[str], *, task_paths: list[str], batch_size: int,
                device: str, dtype: str) -> dict[str, dict[str, Any]]:
    """lm-eval-harness on the converted model directory; metrics per task (lm-eval's `acc,none` is `acc`)."""
    from megalaunch.errors import require

    require("lm_eval", "eval")
    os.environ.update(OFFLINE_ENV)
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = _task_manager(TaskManager, tasks, task_paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise EvalTaskError(f"unknown lm-eval task(s): {', '.join(unknown)}", field="eval.tasks",
                            valid="lm-eval task names, or tasks of YAML files under eval.task_paths",
                            fix="check the names: python -m lm_eval ls tasks")
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": dtype},
                                  tasks=list(tasks), batch_size=batch_size, device=device, task_manager=manager,
                                  log_samples=False)
    results: dict[str, dict[str, Any]] = {}
    for task, metrics in (out or {}).get("results", {}).items():
        clean = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k}
        results[task] = {**clean, "runner": "lm-eval"}
    return results


def _task_manager(manager_class: Any, tasks: list[str], task_paths: list[str]) -> Any:
    """lm-eval's task index. Indexing its built-in tasks parses ~14,000 YAML files (17.5 CPU-s measured on
    a 2-core machine, lm-eval 0.4.13): when eval.task_paths holds every task asked for, index only those."""
    if task_paths:
        try:
            local = manager_class(include_path=list(task_paths), include_defaults=False)
        except TypeError:  # an lm-eval without include_defaults
            local = None
        if local is not None and all(t in local.all_tasks for t in tasks):
            return local
    return manager_class(include_path=list(task_paths) or None)
