"""datatrove pipeline steps of one dump: `PlanReader` (the plan's files of this task, read with
datatrove's own readers) -> `MegatronTokenize` (batched fast encoding, one write per batch).

Why not datatrove's MegatronDocumentTokenizer as-is: it converts and writes every document
separately, updates per-document statistics and keeps Python lists of sizes; that costs ~15 % of the
tokenizer's throughput. This step does the same job per batch: `encode_batch_fast` (no offsets),
one numpy concatenation with BOS/EOS inserted vectorized, one write, one stats update; output files
appear under their final names only when complete (see data/writer.py)."""

from __future__ import annotations

import os
import time

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.utils.batching import batched

from megalaunch.tokenization.encoder import load_encoder

PROGRESS_INTERVAL_S = float(os.environ.get("MEGALAUNCH_TOKENIZE_PROGRESS_S", "5"))
# `recent` in a progress file: the last samples of (time, tokens), about a minute at 5 s, for `status`'s rate
RECENT_SAMPLES = 13
# Tests only: seconds to sleep after each batch, so a job can be killed halfway on purpose.
_BATCH_DELAY_S = float(os.environ.get("MEGALAUNCH_TOKENIZE_BATCH_DELAY_S", "0"))


def reader_for(path: str, text_key: str, id_key: str) -> BaseDiskReader:
    """datatrove's reader for one file's format, rooted at the file's directory."""
    folder = os.path.dirname(path)
    name = os.path.basename(path)
    if name.endswith(".parquet"):
        from datatrove.pipeline.readers import ParquetReader

        return ParquetReader(folder, text_key=text_key, id_key=id_key)
    if name.endswith((".csv", ".csv.gz")):
        from datatrove.pipeline.readers import CSVReader

        return CSVReader(folder, text_key=text_key, id_key=id_key)
    from datatrove.pipeline.readers import JsonlReader

    return JsonlReader(folder, text_key=text_key, id_key=id_key)


class PlanReader(PipelineStep):
    """Read the files the plan gave to this task (rank), in plan order."""

    name = "📖 Plan reader"
    type = "📖 - READER"

    def __init__(self, task_files: list[list[str]], text_key: str = "text", id_key: str = "id") -> None:
        super().__init__()
        self.task_files = task_files
        self.text_key = text_key
        self.id_key = id_key

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        for path in self.task_files[rank]:
            reader = reader_for(path, self.text_key, self.id_key)
            n = 0
            for doc in reader.read_file(os.path.basename(path)):
                n += 1
                yield doc
            self.stat_update("input_files")
            self.stat_update("documents", value=n, unit="input_file")


class MegatronTokenize(PipelineStep):
    """Tokenize documents in batches into `<output_dir>/<name>_...` Megatron .bin/.idx pairs.

    `name_for_rank(rank)` gives the output prefix of each task. `progress_dir`, when set, receives
    `<rank>.json` with documents and tokens so far every few seconds (for `tokenize status`)."""

    name = "✍️ Megatron tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, *, output_dir: str, output_names: list[str], tokenizer_path: str,
                 bos: str | None = None, eos: str | None = None, add_special_tokens: bool = False,
                 batch_size: int = 1000, progress_dir: str | None = None) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.output_names = output_names
        self.tokenizer_path = tokenizer_path
        self.bos = bos
        self.eos = eos
        self.add_special_tokens = add_special_tokens
        self.batch_size = batch_size
        self.progress_dir = progress_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from megalaunch.data.writer import IndexedWriter

        encoder = load_encoder(self.tokenizer_path, bos=self.bos, eos=self.eos,
                               add_special_tokens=self.add_special_tokens)
        os.makedirs(self.output_dir, exist_ok=True)
        prefix = os.path.join(self.output_dir, self.output_names[rank])
        progress = _Progress(self.progress_dir, rank)
        with IndexedWriter(prefix, encoder.dtype) as writer:
            for batch in batched(data, self.batch_size):
                with self.track_time(unit="batch"):
                    tokens, lengths = encoder.encode([doc.text for doc in batch])
                    writer.add_array(tokens, lengths)
                self.stats["documents"].update(len(batch), unit="batch")
                self.stats["tokens"].update(len(tokens), unit="batch")
                progress.update(len(batch), len(tokens))
                if _BATCH_DELAY_S:
                    time.sleep(_BATCH_DELAY_S)
        progress.finish()
        return
        yield  # a generator, like every datatrove step


class _Progress:
    """Documents/tokens so far, written atomically every PROGRESS_INTERVAL_S seconds and at the end."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.path = os.path.join(directory, f"{rank:05d}.json") if directory else None
        self.started = time.time()
        self.last = 0.0
        self.documents = 0
        self.tokens = 0
        self.recent: list[tuple[float, int]] = []
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._write(done=False)

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        if self.path and now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self._write(done=False)

    def finish(self) -> None:
        if self.path:
            self._write(done=True)

    def _write(self, *, done: bool) -> None:
        from megalaunch.rundir.files import atomic_write_json

        assert self.path is not None
        now = time.time()
        self.recent = [*self.recent, (now, self.tokens)][-RECENT_SAMPLES:]
        atomic_write_json(self.path, {"documents": self.documents, "tokens": self.tokens, "done": done,
                                      "started": self.started, "updated": now, "pid": os.getpid(),
                                      "host": os.uname().nodename, "recent": self.recent})

