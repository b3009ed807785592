"""The tokenization recipe: a frozen, strictly built dataclass. Each component gets its slice:
`inputs` -> the planner, `tokenizer` -> the pipeline, `slurm` -> the job array."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megalaunch.config.typed import build, doc
from megalaunch.errors import ConfigError
from megalaunch.rundir.tokenize import TokenizeRun

# Extensions the datatrove readers take (see tokenization/pipeline.py for the mapping).
INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".ndjson",
                  ".parquet", ".csv", ".csv.gz")


@dataclass(frozen=True, kw_only=True)
class InputsConfig:
    roots: list[str] = doc("Directories (or single files) searched recursively for input files.", path="path")
    filter_in: list[str] = doc("Glob patterns (on the path relative to its root; `**` crosses directories); "
                               "a file must match one. Empty: every supported extension.", [])
    filter_out: list[str] = doc("Glob patterns; a matching file is left out.", [])
    text_key: str = doc("Field holding the document text.", "text")
    id_key: str = doc("Field holding the document id (reported in logs only).", "id")

    def __post_init__(self) -> None:
        if not self.roots:
            raise ValueError("inputs.roots is empty: name at least one directory with input files")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    path: str = doc("Local tokenizer.json (hubs are unreachable from compute nodes).", path="path")
    bos: str | None = doc("Token prepended to every document, or null for none.", None)
    eos: str | None = doc("Token appended to every document (Megatron's document separator), or null.",
                          "<|endoftext|>")
    add_special_tokens: bool = doc("Also apply the tokenizer's own post-processor template "
                                   "(usually false: bos/eos above say it explicitly).", False)
    batch_size: int = doc("Documents per encode_batch call and per write (memory grows with it).", 1000)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"tokenizer.batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True, kw_only=True)
class TokenizeSlurm:
    partition: str | None = doc("Slurm partition (CPU nodes).", None)
    account: str | None = doc("Slurm account.", None)
    qos: str | None = doc("Slurm QOS.", None)
    time: str = doc("Time limit of one dump job (HH:MM:SS or D-HH:MM:SS).", "04:00:00")
    mem: str | None = doc("Memory per job, e.g. 64G (null: the partition's default).", None)
    max_concurrent: int = doc("Array throttle: at most this many dumps run at once (`--array=...%N`).", 8)
    options: dict[str, str] = doc("Further #SBATCH options, name -> value (e.g. constraint: cpu).", {})
    setup: list[str] = doc("Shell lines run before the job (module load ..., source venv/bin/activate).", [])
    python: str = doc("Python interpreter on the compute nodes (default: the one running megalaunch).", "")

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"slurm.max_concurrent must be >= 1, got {self.max_concurrent}")


@dataclass(frozen=True, kw_only=True)
class TokenizeRecipe:
    name: str = doc("Job name prefix; the array is named `tok-<name>`. Empty: from the input folders' names "
                    "(`inputs.roots`), so runs over different sources tell apart in squeue.", "")
    inputs: InputsConfig = doc("Where the raw documents are.")
    tokenizer: TokenizerConfig = doc("How documents become tokens.")
    n_dumps: int = doc("Number of dumps (one Slurm array task each), balanced by input bytes.", 1)
    tasks: int = doc("datatrove tasks per dump (each writes one .bin/.idx pair; the unit of resume).", 1)
    workers: int = doc("Tasks run at once per dump = CPUs per job (-1: as many as tasks).", -1)
    output_dir: str = doc("Where the .bin/.idx files go (empty: RUN/output).", "", path="path")
    backend: Literal["slurm", "local"] = doc("Where `tokenize submit` runs the dumps.", "slurm")
    slurm: TokenizeSlurm = doc("CPU-only resources of each dump job.", TokenizeSlurm())

    def __post_init__(self) -> None:
        if not self.name:  # frozen: set once, here, so recipe.yaml records the name the array gets
            object.__setattr__(self, "name", name_from_inputs(self.inputs.roots))
        if self.n_dumps < 1:
            raise ValueError(f"n_dumps must be >= 1, got {self.n_dumps}")
        if self.tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {self.tasks}")
        if self.workers == 0 or self.workers < -1:
            raise ValueError(f"workers must be -1 or >= 1, got {self.workers}")

    @property
    def concurrent_workers(self) -> int:
        return self.tasks if self.workers == -1 else min(self.workers, self.tasks)


def name_from_inputs(roots: list[str]) -> str:
    """A job name from the input roots' last components (`/data/raw/web` -> `web`, two roots ->
    `web+code`, more -> `web+code+3-more`), a file's without its extension, limited to what an #SBATCH
    line takes; `tokenize` when nothing is left."""
    names: list[str] = []
    for root in roots:
        base = os.path.basename(root.rstrip("/"))
        base = next((base[: -len(s)] for s in INPUT_SUFFIXES if base.endswith(s) and len(base) > len(s)), base)
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.")[:40]
        if base and base not in names:
            names.append(base)
    if not names:
        return "tokenize"
    return "+".join(names[:2]) + (f"+{len(names) - 2}-more" if len(names) > 2 else "")


def load_tokenize_recipe(ref: str, sets: list[str] | tuple[str, ...] = ()) -> tuple[TokenizeRecipe, dict[str, Any]]:
    """A tokenization recipe from a YAML file or a shipped name (`tokenize/NAME`), through the same
    loader as training recipes (includes, provenance, did-you-mean; `--set` > file > includes >
    defaults). Returns the typed recipe and the merged mapping."""
    from megalaunch.config.loader import load_tree

    tree, _ = load_tree(ref, sets, schema=TokenizeRecipe, group="tokenize", anchor=_anchor_paths)
    return build(TokenizeRecipe, tree), tree


def _anchor_paths(tree: dict[str, Any], base: Path) -> None:
    """Relative paths in a recipe file are relative to the file, so a recipe works from any cwd."""

    from megalaunch.config.paths import expand_path

    def anchor(p: Any, field: str) -> Any:
        if isinstance(p, str) and "\0" in p:  # no file name holds one (Path.resolve would raise ValueError)
            raise ConfigError(f"{p!r} holds a NUL byte", field=field, valid="a path", fix="remove the NUL byte")
        if isinstance(p, str) and "://" not in p:
            p = expand_path(p, field)  # ~ and $VAR, once (config/paths.py), before anchoring
        if isinstance(p, str) and p and not os.path.isabs(p) and "://" not in p:
            return str((base / p).resolve())
        return p

    inputs = tree.get("inputs")
    if isinstance(inputs, dict) and isinstance(inputs.get("roots"), list):
        inputs["roots"] = [anchor(r, f"inputs.roots[{i}]") for i, r in enumerate(inputs["roots"])]
    tok = tree.get("tokenizer")
    if isinstance(tok, dict) and "path" in tok:
        anchored = anchor(tok["path"], "tokenizer.path")
        # keep what looks like a hub id ("org/name") as written, so the error can say what it is
        looks_like_hub = isinstance(tok["path"], str) and re.fullmatch(r"[\w.-]+/[\w.-]+", tok["path"])
        tok["path"] = tok["path"] if looks_like_hub and not os.path.exists(anchored) else anchored
    if tree.get("output_dir"):
        tree["output_dir"] = anchor(tree["output_dir"], "output_dir")
    slurm = tree.get("slurm")
    if isinstance(slurm, dict) and isinstance(slurm.get("python"), str):
        slurm["python"] = expand_path(slurm["python"], "slurm.python")  # a command name stays as it is


def load_run_recipe(run: TokenizeRun) -> TokenizeRecipe:
    """The resolved recipe a tokenization run directory holds."""
    import yaml

    return build(TokenizeRecipe, yaml.safe_load(run.recipe_yaml.read_text()))
