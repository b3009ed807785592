"""Data for evaluation tests and the eval benchmark (no downloads): a corpus a tiny model learns in a
few dozen steps (words of a fixed cycle, each document a stretch of it), its byte-level BPE tokenizer,
the tokenized .bin/.idx, and multiple-choice task files (good and broken) in megalaunch's local format."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CYCLE = ["amber", "birch", "cedar", "dune", "ember", "fjord", "grove", "heath", "inlet", "jade", "kelp", "lagoon",
         "marsh", "nectar", "oasis", "pine", "quartz", "reef", "sage", "tundra", "umber", "vale", "willow", "yarrow"]


@dataclass(frozen=True)
class EvalData:
    tokenizer: Path  # tokenizer.json
    prefix: Path  # dataset prefix (.bin/.idx)
    task: Path  # a good local task: which word follows
    broken_task: Path  # answer index out of range on line 2
    lm_eval_tasks: Path  # a directory with one lm-eval task YAML (cycle_mc) over the good task's JSON file


def documents(n_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        start, length = rng.randrange(len(CYCLE)), rng.randint(40, 120)
        docs.append(" ".join(CYCLE[(start + i) % len(CYCLE)] for i in range(length)) + ".")
    return docs


def task_lines(n: int, seed: int = 1) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randrange(len(CYCLE))
        context = " ".join(CYCLE[(s + i) % len(CYCLE)] for i in range(4))
        right = CYCLE[(s + 4) % len(CYCLE)]
        wrong = [w for w in rng.sample(CYCLE, 4) if w != right][:2]
        choices = [f" {right}", *(f" {w}" for w in wrong)]
        rng.shuffle(choices)
        out.append({"context": context, "choices": choices, "answer": choices.index(f" {right}")})
    return out


def make_eval_data(folder: Path, *, n_docs: int = 300) -> EvalData:
    from tests.support.corpus import train_bpe_tokenizer
    from tokenizers import Tokenizer

    from megalaunch.data.writer import write_dataset

    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(n_docs)
    tok_path = train_bpe_tokenizer(folder / "tok" / "tokenizer.json", docs, vocab_size=300)
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    prefix = folder / "data" / "cycle"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_dataset(prefix, [[*tok.encode(d).ids, eos] for d in docs])
    task = folder / "next_word.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in task_lines(24)))
    broken = folder / "broken.jsonl"
    lines = task_lines(3)
    lines[1]["answer"] = 7
    broken.write_text("".join(json.dumps(q) + "\n" for q in lines))
    lm_tasks = folder / "lm_eval_tasks"
    lm_tasks.mkdir(exist_ok=True)
    (lm_tasks / "cycle_mc.yaml").write_text(LM_EVAL_TASK.format(data=json.dumps(str(task))))
    return EvalData(tokenizer=tok_path, prefix=prefix, task=task, broken_task=broken, lm_eval_tasks=lm_tasks)


# lm-eval-harness's task format over a local JSON-lines file (the `json` loader of `datasets`: no download)
LM_EVAL_TASK = """task: cycle_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    higher_is_better: true
"""
