"""`megalaunch convert hf-to-mcore | mcore-to-hf`: checkpoint conversion for Llama-family models (and their MoEs).
Commands parse and delegate to megalaunch.conversion; torch, transformers and megatron are imported
inside the commands only."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from megalaunch.cli.options import SetOpt
from megalaunch.cli.output import say, warn

if TYPE_CHECKING:
    from megalaunch.config.schema import Recipe
    from megalaunch.conversion.converter import Report

app = typer.Typer(no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output directory.")]
RecipeOpt = Annotated[str | None, typer.Option("--recipe", "-r", help="Recipe (YAML file or shipped name).")]
IterOpt = Annotated[int | None, typer.Option("--iteration", min=0, help="Iteration to read or write.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Output dtype: auto (the source's), bfloat16, float16, "
                                                       "float32.")]
SubmitOpt = Annotated[bool, typer.Option("--submit", help="Run as a Slurm job with the recipe's cluster settings.")]
GpusOpt = Annotated[int | None, typer.Option("--gpus", min=0, help="GPUs for --submit (default: 1 on GPU "
                                                                 "clusters, else 0).")]
TimeOpt = Annotated[str | None, typer.Option("--time", help="Time limit for --submit (default: the recipe's).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]
FsyncOpt = Annotated[bool, typer.Option("--fsync", help="Flush every output file to the device before returning.")]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def _bytes(text: str) -> int:
    from megalaunch.errors import ConfigError

    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"size {text!r}", field="--max-shard-size", valid="e.g. 5GB, 500MB, 2GiB")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    base = 1024 if "I" in m.group(2).upper() else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(unit or " "))


def _recipe(ref: str | None, sets: list[str] | None) -> Recipe | None:
    if ref is None:
        if sets:
            from megalaunch.errors import ConfigError

            raise ConfigError("--set needs --recipe", field="--set")
        return None
    from megalaunch.config.loader import load_recipe

    return load_recipe(ref, list(sets or [])).recipe


def _run_recipe(checkpoint: Path) -> Recipe | None:
    """The resolved recipe of a run directory (run.yaml), if `checkpoint` is one."""
    run_yaml = checkpoint / "run.yaml"
    if not run_yaml.is_file():
        return None
    import yaml

    from megalaunch.config.loader import load_resolved

    return load_resolved(yaml.safe_load(run_yaml.read_text()))


def _recipe_vocab(recipe: Recipe | None) -> int | None:
    """The recipe tokenizer's vocabulary size (what Megatron pads)."""
    if recipe is None:
        return None
    data = recipe.data
    if data.tokenizer_type == "NullTokenizer":
        return data.vocab_size
    if data.tokenizer_model and Path(os.path.expanduser(data.tokenizer_model)).exists():
        from megalaunch.config.tokenizer import resolve_tokenizer

        return resolve_tokenizer(data.tokenizer_model).vocab_size
    return None


def _command(name: str, positional: Path, options: dict[str, Any], sets: list[str] | None) -> list[str]:
    """The same command for the job, paths made absolute, without --submit."""
    argv = [name, str(positional.absolute())]
    for flag, value in options.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            is_path = isinstance(value, Path) or (flag == "--recipe" and Path(str(value)).exists())
            argv += [flag, str(Path(value).absolute()) if is_path else str(value)]
    for s in sets or []:
        argv += ["--set", s]
    return argv


def _next_hf_to_mcore(out: Path, recipe: str | None) -> str:
    load = shlex.quote(f"checkpoint.load={out.absolute()}")
    return f"next: megalaunch submit {shlex.quote(recipe or 'RECIPE')} --set {load}"


def _next_mcore_to_hf(out: Path) -> str:
    return f"next: AutoModelForCausalLM.from_pretrained({str(out.absolute())!r})"


def _submit(recipe: Recipe | None, command: list[str], out: Path, gpus: int | None, time_limit: str | None,
            then: str) -> None:
    from megalaunch.conversion.submit import submit
    from megalaunch.errors import ConfigError

    if recipe is None:
        raise ConfigError("--submit needs the cluster settings of a recipe", field="--recipe",
                          fix="pass --recipe R (or a run directory, whose run.yaml is used)")
    done = submit(recipe, command, out, gpus=gpus, time_limit=time_limit)
    say(f"submitted conversion job {done.job_id}: {done.script}")
    say(f"logs: {done.logs}/; next: squeue -j {done.job_id}")
    say(f"when it has finished, {then}")


def _quiet_megatron() -> None:
    """Megatron's import-time warnings (no Transformer Engine/Apex, no absl, no CUDA runtime) are noise
    in a conversion; --debug shows them."""
    if os.environ.get("MEGALAUNCH_DEBUG") != "1":
        from megalaunch.conversion.quiet_imports import import_megatron_quietly

        import_megatron_quietly()


def _print_report(report: Report, what: str) -> None:
    for note in report.notes:
        warn(f"megalaunch: note: {note}")
    say(f"{what}: {report.tensors} tensors, {report.bytes / 1e9:.3f} GB in {report.seconds:.1f} s "
        f"({report.gb_per_s:.2f} GB/s) -> {report.output}")


@app.command("hf-to-mcore")
def hf_to_mcore(
    hf_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json + safetensors).")],
    out: OutOpt,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    iteration: IterOpt = None,
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="TP whose vocabulary padding to use "
                                                               "(default: the recipe's).")] = None,
    dtype: DtypeOpt = "auto",
    threads: Annotated[int, typer.Option("--threads", min=1, help="Writer threads (memory is bounded by "
                                                                  "--max-inflight-gb, not by this).")] = 4,
    max_inflight_gb: Annotated[float | None, typer.Option(
        "--max-inflight-gb", min=0.001, help="Bytes of tensors read/written at once (default: 1.5x the largest "
                                            "tensor group; a larger tensor runs alone).")] = None,
    crc32: Annotated[bool, typer.Option("--crc32", help="Store zip CRC32s in the checkpoint files (torch.load "
                                                        "never checks them; costs CPU time).")] = False,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
    fsync: FsyncOpt = False,
    submit: SubmitOpt = False,
    gpus: GpusOpt = None,
    time_limit: TimeOpt = None,
) -> None:
    """Hugging Face -> Megatron-core torch_dist checkpoint (loads with any TP/PP).

    Writes OUT/release (Megatron loads it as weights: iteration 0, fresh optimizer), or OUT/iter_N
    with --iteration N, and OUT/latest_checkpointed_iteration.txt last."""
    loaded = _recipe(recipe, set_)
    if submit:
        command = _command("hf-to-mcore", hf_dir, {"--out": out, "--recipe": recipe, "--iteration": iteration,
                                                   "--tp": tp, "--dtype": dtype, "--threads": threads,
                                                   "--max-inflight-gb": max_inflight_gb, "--crc32": crc32,
                                                   "--overwrite": overwrite, "--fsync": fsync,
                                                   "--no-progress": True}, set_)
        _submit(loaded, command, out, gpus, time_limit, _next_hf_to_mcore(out, recipe))
        return
    from megalaunch.conversion.converter import read_hf_config

    read_hf_config(hf_dir)  # a missing model directory or config is refused before torch is imported
    _quiet_megatron()
    from megalaunch.conversion.to_mcore import hf_to_mcore as convert

    tensor_parallel = tp or (loaded.parallel.tensor_model_parallel_size if loaded else 1)
    report = convert(hf_dir, out, model=loaded.model if loaded else None, vocab_size=_recipe_vocab(loaded),
                     tensor_parallel=tensor_parallel, iteration=iteration, dtype=dtype, threads=threads,
                     max_inflight_bytes=int(max_inflight_gb * 1e9) if max_inflight_gb else None,
                     overwrite=overwrite, progress=progress, fsync=fsync, crc32=crc32)
    _print_report(report, "hf-to-mcore")
    say(_next_hf_to_mcore(out, recipe))


@app.command("mcore-to-hf")
def mcore_to_hf(
    checkpoint: Annotated[Path, typer.Argument(help="Run directory, its checkpoints/ directory, or an "
                                                    "iter_N directory.")],
    out: OutOpt,
    iteration: IterOpt = None,
    hf_template: Annotated[Path | None, typer.Option("--hf-template", help="A Hugging Face directory whose "
                                                                          "config and tokenizer to use (a "
                                                                          "tokenizer directory: tokenizer "
                                                                          "only).")] = None,
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    family: Annotated[str | None, typer.Option("--family", help="llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe "
                                                                "| qwen3_moe | deepseek_v3 (when no Hugging Face config travels "
                                                                "with the checkpoint).")] = None,
    vocab_size: Annotated[int | None, typer.Option("--vocab-size", min=1, help="Rows to keep (strips "
                                                                               "Megatron's padding).")] = None,
    dtype: DtypeOpt = "auto",
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors file.")] = "5GB",
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
    fsync: FsyncOpt = False,
    submit: SubmitOpt = False,
    gpus: GpusOpt = None,
    time_limit: TimeOpt = None,
) -> None:
    """Megatron-core checkpoint (only complete ones: tracker and metadata checked) -> Hugging Face."""
    from megalaunch.conversion.families import FAMILY_ARCHITECTURE
    from megalaunch.errors import ConfigError

    if family is not None and family not in FAMILY_ARCHITECTURE:
        raise ConfigError(f"unknown family {family!r}", field="--family", valid=", ".join(sorted(FAMILY_ARCHITECTURE)))
    shard_bytes = _bytes(max_shard_size)
    loaded = _recipe(recipe, set_)
    if submit:
        command = _command("mcore-to-hf", checkpoint, {
            "--out": out, "--iteration": iteration, "--hf-template": hf_template, "--recipe": recipe,
            "--family": family, "--vocab-size": vocab_size, "--dtype": dtype, "--max-shard-size": max_shard_size,
            "--overwrite": overwrite, "--fsync": fsync, "--no-progress": True}, set_)
        _submit(loaded or _run_recipe(checkpoint), command, out, gpus, time_limit, _next_mcore_to_hf(out))
        return
    from megalaunch.conversion.checkpoint_io.mcore_layout import resolve

    # a missing or unfinished checkpoint is refused before torch is imported (its shards are read after)
    resolve(checkpoint, iteration, shards=False)
    _quiet_megatron()
    from megalaunch.conversion.to_hf import mcore_to_hf as convert

    report = convert(checkpoint, out, iteration=iteration, hf_template=hf_template, family=family,
                     model=loaded.model if loaded else None, vocab_size=vocab_size or _recipe_vocab(loaded),
                     dtype=dtype, max_shard_bytes=shard_bytes, overwrite=overwrite, progress=progress,
                     fsync=fsync)
    _print_report(report, "mcore-to-hf")
    say(_next_mcore_to_hf(out))
