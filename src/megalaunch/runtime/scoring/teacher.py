"""The teacher stage of distillation: a frozen teacher's top-k next-token log-probabilities for every token of
the run's chat data, stored beside it (RUN/scores/teacher, kind "topk", store.py) for the distillation
flow (runtime/flows/distill.py) to read.

`python -m megalaunch.runtime.scoring.teacher RUN` (the chain's first stage runs it in `job begin` after the
chat data is tokenized, launcher/chain/first_stage.py; by hand it does the same). It reads the run's
recipe (post_training.teacher, teacher_top_k, model.seq_length) and frozen blend (data_blend.txt), and:
- a teacher that is a Megatron checkpoint (not a Hugging Face directory) is converted first with
  `convert mcore-to-hf` into RUN/scores/teacher_hf, removed once the scores are complete;
- the teacher must share the run's tokenizer (RUN/tokenizer): its tokenizer.json's digest, else its
  vocabulary, must equal the run's; a teacher of another vocabulary is refused (one line);
- documents are scored in order, in batches of about `--batch-tokens` tokens, with transformers (bf16 on a
  GPU, float32 on the CPU), each truncated to seq_length + 1 tokens (what a training sequence holds);
  row j of a document holds the k largest log-probabilities (raw: temperature 1, the flow applies its own)
  predicting token j, over the tokenizer's ids (a model's padding rows are never a top id, their mass is
  part of the rest). The store is flushed every `--flush-s` seconds: a stage that stops continues from
  documents_done. Progress and tokens/s are printed; meta.json records seconds and tokens_per_s."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.scoring.store import Documents, ScoreWriter, fingerprint, prefix_name, read_meta

TEACHER_SCORES = "scores/teacher"
CONVERTED = "scores/teacher_hf"


class TeacherRefused(Exception):
    """A teacher that cannot score this run's data: the one-line reason (with its fix)."""


def blend_prefixes(paths: RunPaths) -> list[str]:
    """The prefixes of the run's frozen blend (data_blend.txt: `weight prefix weight prefix ...`, relative
    prefixes under the run directory), in its order."""
    words = paths.data_blend.read_text().split()
    return [os.path.normpath(os.path.join(paths.root, p)) for p in words[1::2]]


@dataclass(frozen=True)
class TeacherJob:
    """What the stage needs of the run: where, which teacher, how many ids, how long a sequence."""

    paths: RunPaths
    teacher: str
    top_k: int
    max_tokens: int  # seq_length + 1: the tokens of one training sequence (inputs and the last label)
    prefixes: list[str]
    cpu: bool = False  # the run trains on CPUs (cluster.gpus_per_node 0): the teacher too, whatever the node has

    @property
    def store(self) -> Path:
        return self.paths.root / TEACHER_SCORES

    @classmethod
    def of_run(cls, root: str | os.PathLike[str]) -> TeacherJob:
        """From the run's files (runtime.json's post_training, megatron.args' --seq-length): the stage's process."""
        from megalaunch.runtime.rank.settings import RuntimeSettings

        paths = RunPaths(Path(os.path.abspath(root)))
        args = paths.megatron_args.read_text().split("\n") if paths.megatron_args.is_file() else []
        seq = int(args[args.index("--seq-length") + 1]) if "--seq-length" in args[:-1] else 4096
        settings = RuntimeSettings.load(paths)
        job = cls.of_settings(paths, settings.post_training, seq + 1)
        return replace(job, cpu=settings.cpu)

    @classmethod
    def of_settings(cls, paths: RunPaths, post_training: dict[str, Any] | None, max_tokens: int = 0) -> TeacherJob:
        """From the post_training section as a dict (RUN/runtime.json's) and the frozen blend."""
        pt = post_training or {}
        if pt.get("method") != "distill" or not pt.get("teacher"):
            raise TeacherRefused(f"{paths.root} is not a distillation run (post_training.method {pt.get('method')}); "
                                 "fix: --set post_training.method=distill --set post_training.teacher=DIR")
        if not paths.data_blend.is_file():  # mock data (a run with chat files has its blend by now)
            raise TeacherRefused("distillation needs chat data (the run has data.mock: true); fix: megalaunch submit "
                                 "RECIPE --data CHATS_DIR (or data.blend of `megalaunch data sft` output)")
        prefixes = blend_prefixes(paths)
        names = [prefix_name(p) for p in prefixes]
        if len(set(names)) != len(names):  # the store names a dataset's rows by its prefix's basename
            twice = sorted({n for n in names if names.count(n) > 1})
            raise TeacherRefused(f"the blend holds datasets of the same name ({', '.join(twice)}) in different "
                                 "directories: their teacher scores would share files; fix: give them distinct names")
        return cls(paths=paths, teacher=str(pt["teacher"]), top_k=int(pt.get("teacher_top_k") or 32),
                   max_tokens=max_tokens, prefixes=prefixes)

    def model_record(self) -> dict[str, str]:
        return {"fingerprint": fingerprint(self.teacher), "source": self.teacher}


def resolved_mode(post_training: dict[str, Any] | None) -> str:
    """Where the teacher runs, as decided at submit (config/training/teacher_plan.py): stage or online."""
    pt = post_training or {}
    mode = str(pt.get("teacher_mode_resolved") or pt.get("teacher_mode") or "stage")
    return mode if mode in ("stage", "online") else "stage"


def is_complete(job: TeacherJob) -> bool:
    """The store holds this teacher's scores of every document (the stage has nothing to do)."""
    meta = read_meta(job.store)
    if not meta or not meta.get("complete") or (meta.get("model") or {}).get("source") != job.teacher:
        return False
    if meta.get("top_k") != job.top_k or set(meta.get("data") or {}) != {prefix_name(p) for p in job.prefixes}:
        return False
    return bool((meta.get("model") or {}).get("fingerprint") == fingerprint(job.teacher))


def is_hf_model(path: Path) -> bool:
    return (path / "config.json").is_file()


def _teacher_tokenizer(source: Path) -> Path | None:
    """The tokenizer beside a Megatron teacher: its run's RUN/tokenizer (source a run, its checkpoints/ or
    an iter_N directory), else None."""
    for up in (source, source.parent, source.parent.parent):
        if (up / "tokenizer").is_dir() and (up / "run.yaml").is_file():
            return up / "tokenizer"
    return None


def convert_teacher(job: TeacherJob, log: Callable[[str], None]) -> Path:
    """The teacher as a Hugging Face directory: itself, or converted from a Megatron checkpoint."""
    source = Path(job.teacher).expanduser()
    if not source.exists():
        raise TeacherRefused(f"post_training.teacher {job.teacher} does not exist; fix: --set "
                             "post_training.teacher=DIR (a Hugging Face model directory or a megatron checkpoint)")
    if is_hf_model(source):
        return source
    out = job.paths.root / CONVERTED
    if is_hf_model(out) and (out / ".source").is_file() and (out / ".source").read_text() == job.teacher:
        return out
    command = [sys.executable, "-m", "megalaunch.cli.main", "convert", "mcore-to-hf", str(source), "--out", str(out),
               "--no-progress", "--overwrite"]
    tokenizer = _teacher_tokenizer(source)
    if tokenizer is not None:
        command += ["--hf-template", str(tokenizer)]
    log(f"teacher: converting the megatron checkpoint {source} into {out}")
    proc = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not is_hf_model(out):
        lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        why = lines[-1].removeprefix("megalaunch: error: ") if lines else f"exit status {proc.returncode}"
        raise TeacherRefused(f"converting post_training.teacher {job.teacher} to Hugging Face failed: {why}; "
                             "fix: a complete megatron checkpoint or a Hugging Face model directory")
    (out / ".source").write_text(job.teacher)
    return out


def check_vocabulary(teacher_dir: Path, tokenizer_dir: Path) -> None:
    """Refuse a teacher whose tokenizer is not the run's: same tokenizer.json, or the same vocabulary."""
    def digest(directory: Path) -> str | None:  # as runtime/flows/chat_format.py's tokenizer_digest
        path = directory / "tokenizer.json"
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    mine, theirs = digest(tokenizer_dir), digest(teacher_dir)
    if mine is not None and mine == theirs:
        return
    from transformers import AutoTokenizer

    fix = "fix: --set post_training.teacher=DIR of a teacher with the student's tokenizer"
    try:
        teacher_vocab = AutoTokenizer.from_pretrained(str(teacher_dir)).get_vocab()
    except Exception as e:  # no tokenizer there, or one transformers cannot read
        raise TeacherRefused(f"post_training.teacher {teacher_dir} has no tokenizer to compare with the run's "
                             f"({type(e).__name__}); {fix}") from None
    student_vocab = AutoTokenizer.from_pretrained(str(tokenizer_dir)).get_vocab()
    if teacher_vocab != student_vocab:
        differ = sum(1 for t, i in student_vocab.items() if teacher_vocab.get(t) != i)
        raise TeacherRefused(f"post_training.teacher {teacher_dir}'s tokenizer differs from the run's "
                             f"({len(teacher_vocab)} vs {len(student_vocab)} entries, {differ} of the run's ids "
                             f"differ): the teacher must share the student's vocabulary; {fix}")


class TeacherModel:
    """A frozen Hugging Face causal LM scoring batches of documents: top-k log-probabilities per row."""

    def __init__(self, hf_dir: Path, *, top_k: int, vocab: int, device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
        self.model = model.to(self.device).eval()
        self.top_k, self.vocab = top_k, vocab
        self.model.requires_grad_(False)

    def score(self, docs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per document of n tokens: (ids int32 [n, k], logp float32 [n, k]); row 0 zeros, row j from
        position j - 1 (the distribution predicting token j)."""
        torch = self.torch
        longest = max(len(d) for d in docs)
        if longest < 2:  # nothing to predict (a document of one token)
            return [(np.zeros((len(d), self.top_k), np.int32), np.zeros((len(d), self.top_k), np.float32)) for d in docs]
        batch = torch.zeros((len(docs), longest), dtype=torch.long)
        for i, d in enumerate(docs):  # right padding: under causal attention it never reaches real tokens
            batch[i, : len(d)] = torch.from_numpy(d.astype(np.int64))
        with torch.inference_mode():
            logits = self.model(input_ids=batch.to(self.device), use_cache=False).logits
            out = []
            for i, d in enumerate(docs):
                logp = torch.log_softmax(logits[i, : len(d) - 1].float(), dim=-1)
                values, ids = torch.topk(logp[:, : self.vocab], self.top_k, dim=-1)
                top_ids = np.zeros((len(d), self.top_k), dtype=np.int32)
                top_logp = np.zeros((len(d), self.top_k), dtype=np.float32)
                top_ids[1:], top_logp[1:] = ids.int().cpu().numpy(), values.cpu().numpy()
                out.append((top_ids, top_logp))
        return out

    def topk(self, tokens: Any) -> tuple[Any, Any]:
        """Online: tokens [b, s] (a micro-batch's inputs, on this device) -> (ids int64 [b, s, k], log-probabilities
        float32 [b, s, k]) of the distribution at every position (position i predicts token i + 1: the label)."""
        torch = self.torch
        with torch.no_grad():
            logits = self.model(input_ids=tokens.to(self.device), use_cache=False).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # over every row: padding rows' mass is the rest's
            values, ids = torch.topk(logp[..., : self.vocab], self.top_k, dim=-1)
        return ids.long().clone(), values.float().clone()


def score_prefix(writer: ScoreWriter, teacher: TeacherModel, prefix: str, *, max_tokens: int, batch_tokens: int,
                 flush_s: float, log: Callable[[str], None]) -> tuple[int, float]:
    """Score the documents of `prefix` from documents_done on: (tokens scored, seconds)."""
    name = prefix_name(prefix)
    docs = Documents(prefix)
    stream, offsets, lengths = docs.tokens, docs.offsets, docs.lengths
    start, total = writer.done(name), len(lengths)
    tokens = seconds = 0.0
    stretch_tokens, stretch_start, last_flush = 0, time.monotonic(), time.monotonic()
    doc = start
    while doc < total:
        batch: list[np.ndarray] = []
        while doc < total and (not batch or (len(batch) + 1) * max(len(b) for b in batch) <= batch_tokens):
            n = min(int(lengths[doc]), max_tokens)
            batch.append(np.asarray(stream[int(offsets[doc]): int(offsets[doc]) + n]))
            doc += 1
        writer.append(name, teacher.score(batch))
        stretch_tokens += sum(len(b) for b in batch)
        if time.monotonic() - last_flush >= flush_s or doc == total:
            elapsed = time.monotonic() - stretch_start
            writer.flush(seconds=elapsed, tokens=stretch_tokens)
            tokens, seconds = tokens + stretch_tokens, seconds + elapsed
            log(f"teacher: {name}: {doc}/{total} documents, {stretch_tokens / max(elapsed, 1e-9):.0f} tokens/s")
            stretch_tokens, stretch_start, last_flush = 0, time.monotonic(), time.monotonic()
    return int(tokens), seconds


def run_teacher_stage(root: str | os.PathLike[str], *, batch_tokens: int = 8192, flush_s: float = 30.0,
                      device: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Score the run's chat data with its teacher into RUN/scores/teacher (continuing a stopped stage);
    the store's meta.json at the end."""
    job = TeacherJob.of_run(root)
    if is_complete(job):
        log(f"teacher: {job.store} is complete")
        return read_meta(job.store) or {}
    model_record = job.model_record()  # of the source named in the recipe, before any conversion
    hf_dir = convert_teacher(job, log)
    check_vocabulary(hf_dir, job.paths.tokenizer)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(job.paths.tokenizer)))
    writer = ScoreWriter(job.store, kind="topk", prefixes=job.prefixes, model=model_record, top_k=job.top_k)
    if writer.restarted_because is not None:
        log(f"teacher: starting {job.store} afresh: {writer.restarted_because.reason}")
    teacher = TeacherModel(hf_dir, top_k=job.top_k, vocab=vocab, device=device or ("cpu" if job.cpu else None))
    log(f"teacher: {job.teacher} (top {job.top_k}) on {teacher.device.type}, {len(job.prefixes)} dataset(s)")
    tokens, seconds = 0, 0.0
    try:
        for prefix in job.prefixes:
            t, s = score_prefix(writer, teacher, prefix, max_tokens=job.max_tokens, batch_tokens=batch_tokens,
                                flush_s=flush_s, log=log)
            tokens, seconds = tokens + t, seconds + s
        writer.flush(complete=True)
    finally:
        writer.close()
    if hf_dir == job.paths.root / CONVERTED:
        shutil.rmtree(hf_dir, ignore_errors=True)
    meta = read_meta(job.store) or {}
    log(f"teacher: scored {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s; "
        f"store {meta.get('tokens_per_s', 0.0):.0f} tokens/s over {meta.get('seconds', 0.0):.1f} s)")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalaunch.runtime.scoring.teacher",
                                     description="Score a distillation run's chat data with its teacher.")
    parser.add_argument("run_dir")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="tokens per teacher forward (padded)")
    parser.add_argument("--flush-s", type=float, default=30.0, help="seconds between durable flushes")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    args = parser.parse_args(argv)
    try:
        run_teacher_stage(args.run_dir, batch_tokens=args.batch_tokens, flush_s=args.flush_s, device=args.device,
                          log=lambda line: print(line, flush=True))
    except TeacherRefused as e:
        print(f"megalaunch: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
