"""Distillation, the student part (post_training.method distill; docs/post_training.md, "Distillation").

The teacher's top-k next-token log-probabilities were computed once by the teacher stage
(runtime/scoring/teacher.py) into RUN/scores/teacher. `TeacherDataset` is the chat dataset
(runtime/flows/chat_dataset.py) with, per label position, the teacher's k ids and log-probabilities: the
store's row j predicts token j, the dataset's label i is token i + 1, so label i gets row i + 1.
`DistillFlow` computes the student's full-vocabulary log-softmax from its logits (vocabulary-parallel under
tensor parallelism) and the loss of runtime/flows/distill_loss.py on the answer tokens: forward or reverse KL
over the teacher's k ids plus a rest bucket, at temperature T (times T^2), mixed with the hard-label loss.
Settings from the recipe's post_training section (`self.config`): kl_direction, hard_label_weight,
temperature, teacher_mode. Online (teacher_mode online), `prepare` loads the Hugging Face teacher into this
process (frozen; bf16 on the GPU) and each micro-batch's top-k comes from it instead of the store: position i
predicts token i + 1, the label, as the stored row i + 1 does. Under tensor parallelism every TP rank runs the
whole teacher (the same numbers on each). Metrics: `distill kl`, `hard-label ce`, `top-1 agreement` (the student's most likely token is
the teacher's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.utils import Split

from megalaunch.runtime.flows.chat_dataset import ChatDataset, ChatDocuments
from megalaunch.runtime.flows.distill_loss import distill_loss, distill_terms, tensor_parallel_reductions
from megalaunch.runtime.flows.flow import DEFAULT_KEYS, Flow, FlowLoss
from megalaunch.runtime.rank.failures import ConfigFailure
from megalaunch.runtime.scoring.store import ScoreReader, data_entry, prefix_name, read_meta

TEACHER_SCORES = "scores/teacher"  # under the run directory (runtime/scoring/teacher.py writes it)


def teacher_store() -> Path:
    """RUN/scores/teacher of the run this process trains (MEGALAUNCH_RUN_DIR, set by the training entry)."""
    run = os.environ.get("MEGALAUNCH_RUN_DIR")
    if not run:
        raise ConfigFailure("distillation needs the run directory (MEGALAUNCH_RUN_DIR) to find the teacher's scores",
                            fix="train through megalaunch (submit / python -m megalaunch.runtime.train RUN)")
    return Path(run) / TEACHER_SCORES


def teacher_mode() -> str:
    """post_training.teacher_mode of the run this process trains (RUN/runtime.json), "stage" when not set."""
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.rank.settings import RuntimeSettings
    from megalaunch.runtime.scoring.teacher import resolved_mode

    return resolved_mode(RuntimeSettings.load(RunPaths(teacher_store().parent.parent)).post_training)


def open_teacher_scores(prefix: str, store: Path) -> ScoreReader:
    """The teacher's complete top-k scores of `prefix`, checked against the dataset they were computed on."""
    fix = f"megalaunch resume {store.parent.parent} (the chain's first stage scores the data with the teacher)"
    meta = read_meta(store)
    if not meta or not meta.get("complete") or meta.get("kind") != "topk":
        raise ConfigFailure(f"{store} holds no complete teacher top-k scores", fix=fix)
    name = prefix_name(prefix)
    held = (meta.get("data") or {}).get(name)
    if held is None or held != data_entry(prefix):
        raise ConfigFailure(f"the teacher's scores in {store} were not computed on {prefix} as it is now", fix=fix)
    return ScoreReader(store, prefixes=[prefix])


class TeacherDataset(ChatDataset):
    """The chat dataset plus the teacher's top-k per label position (`teacher_ids`, `teacher_logp` [seq, k]);
    padding positions hold zeros (their loss mask is 0)."""

    def __init__(self, dataset: ChatDocuments, dataset_path: str | None, indices: numpy.ndarray,
                 num_samples: int | None, index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.online = teacher_mode() == "online"  # the teacher scores each micro-batch in the job: nothing stored
        self.scores = None if self.online else open_teacher_scores(dataset.prefix, teacher_store())
        self.name = prefix_name(dataset.prefix)
        self.top_k = int(self.scores.top_k or 0) if self.scores is not None else 0

    def sample(self, doc: int | None) -> dict[str, torch.Tensor]:
        out = super().sample(doc)
        if self.scores is None:
            return out
        seq = self.config.sequence_length
        ids = numpy.zeros((seq, self.top_k), dtype=numpy.int64)
        logp = numpy.zeros((seq, self.top_k), dtype=numpy.float32)
        if doc is not None:
            rows_ids, rows_logp = self.scores.get(self.name, doc)
            n = min(len(rows_ids), seq + 1)  # the tokens this sequence holds
            if n > 1:
                ids[: n - 1], logp[: n - 1] = rows_ids[1:n], rows_logp[1:n]
        out["teacher_ids"] = torch.from_numpy(ids)
        out["teacher_logp"] = torch.from_numpy(logp)
        return out


class DistillFlow(Flow):
    """KL to the teacher's stored top-k (plus the rest), mixed with the hard-label loss."""

    dataset = TeacherDataset
    teacher: Any = None  # online: the frozen teacher in this process (runtime/scoring/teacher.py's TeacherModel)

    @property
    def keys(self) -> tuple[str, ...]:  # type: ignore[override]
        """The batch tensors: the stored teacher's top-k too, unless the teacher runs online."""
        return DEFAULT_KEYS if self.online else (*DEFAULT_KEYS, "teacher_ids", "teacher_logp")

    @property
    def online(self) -> bool:
        from megalaunch.runtime.scoring.teacher import resolved_mode

        return resolved_mode(getattr(self, "config", None)) == "online"

    def prepare(self, model: Any, context: Any) -> None:
        """Online: load the teacher (frozen, bf16 on this rank's GPU, float32 on the CPU), after checking that it
        shares the run's tokenizer (a one-line configuration error otherwise)."""
        if not self.online or self.teacher is not None:
            return
        from megalaunch.runtime.scoring.teacher import (
            TeacherModel,
            TeacherRefused,
            check_vocabulary,
            is_hf_model,
        )

        source = Path(str(self.setting("teacher", "")))
        run = Path(context.run_dir)
        if not is_hf_model(source):
            raise ConfigFailure(f"post_training.teacher {source} is not a Hugging Face model directory (config.json): "
                                "the online teacher runs with transformers", fix="--set post_training.teacher_mode=stage "
                                "(a megatron teacher is converted by the first stage)")
        try:
            check_vocabulary(source, run / "tokenizer")
        except TeacherRefused as e:
            reason, _, fix = str(e).partition("; fix: ")
            raise ConfigFailure(reason, fix=fix or None) from None
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(run / "tokenizer")))
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.teacher = TeacherModel(source, top_k=int(self.setting("teacher_top_k", 32)), vocab=vocab, device=device)
        context.log(f"distillation: the teacher {source} runs online (top {self.teacher.top_k}) on {device}")

    def setting(self, name: str, default: Any) -> Any:
        """A field of the recipe's post_training section (`self.config`, set by the flow loader)."""
        value = (getattr(self, "config", None) or {}).get(name)
        return default if value is None else value

    def loss(self, model: Any, batch: dict[str, Any]) -> FlowLoss:
        tokens = batch["tokens"]
        rows = tokens.numel()
        logits = model(tokens, batch["position_ids"], None)  # [b, s, V / tp]: Megatron's output without labels
        logits = logits.reshape(rows, logits.shape[-1])
        if self.online:
            if self.teacher is None:
                raise ConfigFailure("post_training.teacher_mode online: the teacher was not loaded before training",
                                    fix="run through megalaunch's training entry (it calls the flow's prepare)")
            ids, logp = self.teacher.topk(tokens)
        else:
            ids, logp = batch["teacher_ids"], batch["teacher_logp"]
        k = ids.shape[-1]
        temperature = float(self.setting("temperature", 1.0))
        terms = distill_terms(logits, ids.reshape(rows, k).to(logits.device), logp.reshape(rows, k).to(logits.device),
                              batch["labels"].reshape(rows), temperature=temperature,
                              direction=str(self.setting("kl_direction", "forward")),
                              red=tensor_parallel_reductions(logits.shape[-1]))
        loss, count, metrics = distill_loss(terms, batch["loss_mask"], temperature=temperature,
                                            hard_label_weight=float(self.setting("hard_label_weight", 0.0)))
        return FlowLoss(loss=loss, count=count, metrics=metrics)
