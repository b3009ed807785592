"""Hugging Face safetensors -> Megatron-core torch_dist checkpoint (`release` or iter_N), several
tensor groups at once on a few threads under a byte budget (converter.py has the shared parts)."""

from __future__ import annotations

import argparse
import itertools
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.config.schema import ModelConfig
from megalaunch.conversion import families, transforms
from megalaunch.conversion.checkpoint_io import mcore_dist, mcore_layout, mcore_save, safetensors_io
from megalaunch.conversion.checkpoint_io.progress import Progress
from megalaunch.conversion.converter import (
    ASSET_FILES,
    ASSETS_DIR,
    CONVERSION_KEY,
    DEFAULT_THREADS,
    INFLIGHT_FACTOR,
    Report,
    _dtype,
    _hf_shapes,
    _numel,
    _offset,
    _prepare_output,
    _stacked_shape,
    largest_group_bytes,
    read_hf_config,
)
from megalaunch.conversion.dims import Dims, padded_vocab_size
from megalaunch.conversion.errors import ConversionError, ShapeMismatchError
from megalaunch.conversion.families_deepseek import megatron_mla_args, mtp_layers
from megalaunch.conversion.families_moe import megatron_moe_args
from megalaunch.conversion.tables import (
    IGNORED_HF_SUFFIXES,
    TABLES,
    Item,
    extra_state_modules,
    items,
    layer_objects,
)

if TYPE_CHECKING:
    import torch

def megatron_args(model: ModelConfig, dims: Dims, *, tensor_parallel: int, iteration: int,
                  dtype: torch.dtype) -> argparse.Namespace:
    """The `args` Megatron stores in a checkpoint, so `--use-checkpoint-args` and the resume checks work,
    and so a later mcore-to-hf knows the model. no_save_optim/no_save_rng: there is no optimizer state."""
    import torch

    return argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=dims.ffn,
        num_attention_heads=model.num_attention_heads, num_query_groups=dims.groups,
        group_query_attention=dims.groups != dims.heads, kv_channels=dims.head_dim, qk_layernorm=dims.qk_norm,
        max_position_embeddings=model.max_position_embeddings, seq_length=model.seq_length,
        position_embedding_type=model.position_embedding_type, add_position_embedding=False,
        rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
        use_rope_scaling=model.use_rope_scaling, rope_scaling_factor=model.rope_scaling_factor,
        normalization=model.normalization, norm_epsilon=model.norm_epsilon, swiglu=model.swiglu,
        add_bias_linear=not model.disable_bias_linear, add_qkv_bias=model.add_qkv_bias,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, vocab_size=dims.vocab,
        padded_vocab_size=dims.padded_vocab, tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=1, ckpt_format="torch_dist", iteration=iteration,
        consumed_train_samples=0, consumed_valid_samples=0, no_save_optim=True, no_save_rng=True,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        **{**megatron_moe_args(model), **megatron_mla_args(model),
           **({"moe_layer_freq": list(dims.moe_pattern)} if dims.moe_pattern else {})},
    )


def check_hf_tensors(reader: safetensors_io.SafetensorsReader, table: Any, dims: Dims, source: Path,
                     family: str = "llama", skipped: tuple[str, ...] = ()) -> None:
    """Every tensor the mapping needs exists with the expected shape; nothing is silently left behind (a
    missing expert, or one more expert than config.json says, is refused before anything is written) except the
    `skipped` ones (DeepSeek-V3's multi-token-prediction layers: the caller notes them)."""
    _check_expert_count(reader, dims, source)
    used: set[str] = set()
    for item in items(table, dims):
        for name, shape in zip(item.hf_names, _hf_shapes(item, dims), strict=True):
            info = reader.tensors.get(name)
            if info is None:
                raise ConversionError(f"tensor '{name}' is missing from {source}",
                                      fix="check that the directory holds the complete model (all shards)")
            if info.shape != shape:
                raise ShapeMismatchError(name, info.shape, shape, source="Hugging Face checkpoint",
                                         fix="the recipe's model section must match the Hugging Face config")
            used.add(name)
    extra = [n for n in reader.tensors if n not in used and not n.endswith(IGNORED_HF_SUFFIXES)
             and not (dims.tied and n == "lm_head.weight") and n not in skipped]
    if extra:
        raise ConversionError(f"{len(extra)} tensors have no mapping, e.g. '{extra[0]}'",
                              fix=f"this model has parts the {family} mapping does not cover")


def _check_expert_count(reader: safetensors_io.SafetensorsReader, dims: Dims, source: Path) -> None:
    """The experts the safetensors hold (`...experts.E.*`: the largest E + 1) are the experts the model
    configuration says, else one line naming model.num_experts (a lone missing tensor is named by the caller)."""
    found = max((_expert_index(n) for n in reader.tensors if _layer_index(n) < dims.num_layers), default=-1) + 1
    if found != dims.num_experts and (found or dims.num_experts):
        raise ConversionError(f"{source} holds {found} experts per layer, the model configuration says "
                              f"{dims.num_experts}", field="model.num_experts",
                              fix="config.json's num_local_experts / num_experts (and the recipe's model.num_experts) "
                                  "must be the checkpoint's expert count")


def _layer_index(name: str) -> int:
    """i of a Hugging Face layer tensor (`model.layers.i.*`), else -1."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit() else -1


def mtp_tensors(reader: safetensors_io.SafetensorsReader, hf_cfg: dict[str, Any], dims: Dims,
                notes: list[str]) -> tuple[str, ...]:
    """DeepSeek-V3's multi-token-prediction modules, stored as layers after the last one (`model.layers.61.*`):
    transformers does not load them either, and Megatron's MTP (`--mtp-num-layers`) is not converted: skipped with
    a note in `notes` rather than refused, so the published checkpoint converts."""
    skipped = tuple(n for n in reader.tensors if _layer_index(n) >= dims.num_layers) if mtp_layers(hf_cfg) else ()
    if skipped:
        notes.append(f"{len(skipped)} multi-token-prediction tensors (model.layers.{dims.num_layers}.* and after) "
                     "skipped: Megatron's MTP layers are not converted")
    return skipped


def _expert_index(name: str) -> int:
    """E of a Hugging Face expert tensor (`...experts.E.w1.weight`), else -1."""
    parts = name.split(".")
    for a, b in itertools.pairwise(parts):
        if a == "experts" and b.isdigit():
            return int(b)
    return -1


def hf_to_mcore(hf_dir: Path, out: Path, *, model: ModelConfig | None = None, vocab_size: int | None = None,
                tensor_parallel: int = 1, iteration: int | None = None, dtype: str | None = None,
                threads: int = DEFAULT_THREADS, max_inflight_bytes: int | None = None, overwrite: bool = False,
                progress: bool = True, fsync: bool = False, crc32: bool = False) -> Report:
    """Convert a Hugging Face Llama-family model (dense or mixture of experts) into a Megatron-core checkpoint under `out`.

    model: the recipe's model section; its architecture must match the Hugging Face config (else an
        error names each differing field). None: derived from the Hugging Face config.
    vocab_size: the recipe tokenizer's vocabulary (Megatron pads it); the embedding keeps all of the
        Hugging Face rows and is padded to the larger of the two.
    tensor_parallel: the TP the recipe trains with (Megatron pads the vocabulary to a multiple of
        make_vocab_size_divisible_by x TP; other TPs still load: Megatron marks the embedding with
        allow_shape_mismatch).
    iteration: None writes a `release` checkpoint (Megatron loads it as weights only: iteration 0, fresh
        optimizer); N writes iter_N (load it with --finetune or --no-load-optim --no-load-rng).
    threads: writer threads; max_inflight_bytes: the bytes of tensors being read, transformed and
        written at once (default INFLIGHT_FACTOR x the largest tensor group; a larger tensor runs alone).
        Peak memory is about this budget above the import baseline, whatever the number of threads.
    fsync: flush every file to the device before returning (durable on power loss; as slow as the
        device's writes). Off, like `save_pretrained`: the tracker is still written last.
    crc32: store zip CRC32s in the torch.save archives (torch.load never checks them; they cost
        about as much CPU as writing the data)."""

    hf_dir, out = Path(hf_dir), Path(out)
    hf_cfg, hf, model, dims = _describe(hf_dir, model, vocab_size, tensor_parallel)
    table = TABLES[hf.family]
    report = Report(output=out, notes=list(hf.notes))
    with safetensors_io.SafetensorsReader(hf_dir) as reader:
        check_hf_tensors(reader, table, dims, hf_dir, hf.family, mtp_tensors(reader, hf_cfg, dims, report.notes))
        work = list(items(table, dims))
        out_dtype = _dtype(dtype) or safetensors_io.torch_dtype(reader.tensors[work[0].hf_names[0]].dtype)
        shards = _lazy_shards(reader, work, dims, out_dtype)
        report.tensors = len(shards)
        report.bytes = sum(s.nbytes for s in shards)
        report.largest_group_bytes = largest_group_bytes(work, dims, out_dtype.itemsize)
        budget = _budget(max_inflight_bytes, report.largest_group_bytes)
        target = _prepare_output(out, iteration, overwrite)
        common = {
            "args": megatron_args(model, dims, tensor_parallel=tensor_parallel, iteration=iteration or 0,
                                  dtype=out_dtype),
            "checkpoint_version": 3.0, "iteration": iteration or 0,
            CONVERSION_KEY: {"version": 1, "family": hf.family, "hf_config": hf_cfg, "source": str(hf_dir),
                             "vocab_size": hf.vocab_size},
        }
        bar = Progress(report.bytes, f"hf-to-mcore {target.name}", progress)
        start = time.perf_counter()
        with mcore_dist.process_group():
            stats = mcore_save.save(target, shards, common, max_inflight_bytes=budget, threads=max(1, threads),
                                  extra_state=_extra_state(dims)[0], num_layers=dims.num_layers, fsync=fsync,
                                  crc32=crc32, on_written=lambda s: bar.update(s.nbytes),
                                  expert_extra_state=_extra_state(dims)[1], num_experts=dims.num_experts,
                                  objects=layer_objects(dims) if dims.layer_keys else None)
        bar.close()
        report.seconds = time.perf_counter() - start
        report.threads, report.max_inflight_bytes = stats.threads, stats.max_inflight_bytes
        report.peak_inflight_bytes = stats.peak_inflight_bytes
    mcore_layout.write_tracker(out, iteration)
    _copy_assets(hf_dir, out / ASSETS_DIR)
    report.output = target
    return report


def _extra_state(dims: Dims) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stacked `_extra_state` objects' modules (none for per-layer keys: `layer_objects` lists those)."""
    return extra_state_modules(dims) if not dims.layer_keys else ((), ())


def _budget(max_inflight_bytes: int | None, largest_group: int) -> int:
    if max_inflight_bytes is not None and max_inflight_bytes <= 0:
        raise ConversionError(f"max in-flight bytes {max_inflight_bytes}", field="--max-inflight-gb",
                              valid="a positive size")
    return max_inflight_bytes or int(INFLIGHT_FACTOR * largest_group)


def _describe(hf_dir: Path, model: ModelConfig | None, vocab_size: int | None,
              tensor_parallel: int) -> tuple[dict[str, Any], families.HFModel, ModelConfig, Dims]:
    """The Hugging Face config, what it describes, the model to write (the recipe's, checked against
    it) and the tensor dimensions with Megatron's padded vocabulary."""
    hf_cfg = read_hf_config(hf_dir)
    divisible = model.make_vocab_size_divisible_by if model else 128
    hf = families.model_from_hf_config(hf_cfg, make_vocab_size_divisible_by=divisible)
    if model is not None:
        diffs = families.differences(model, hf.model)
        if diffs:
            text = "; ".join(f"model.{n}: recipe {a!r}, Hugging Face {b!r}" for n, a, b in diffs)
            raise ConversionError(f"the recipe's model does not match {hf_dir}/config.json: {text}",
                                  fix="fix the recipe (or --set model.FIELD=VALUE) to describe this model")
    model = model or hf.model
    rows = max(hf.vocab_size, vocab_size or 0)
    dims = Dims.from_model(model, vocab=hf.vocab_size, padded_vocab=padded_vocab_size(
        rows, model.make_vocab_size_divisible_by, tensor_parallel))
    return hf_cfg, hf, model, dims


def _lazy_shards(reader: safetensors_io.SafetensorsReader, work: list[Item], dims: Dims,
                 out_dtype: torch.dtype) -> list[mcore_save.LazyShard]:
    """One Megatron tensor per work item, produced from its Hugging Face sources when written."""
    shards = []
    for item in work:
        shape = dims.shape(item.rule.mcore_shape)
        dtype = safetensors_io.torch_dtype(reader.tensors[item.hf_names[0]].dtype) if item.rule.own_dtype else out_dtype
        produce, scratch = _producer(reader, item, dims, dtype)
        shards.append(mcore_save.LazyShard(
            key=item.key, global_shape=_stacked_shape(item, dims), offset=_offset(item, len(shape)),
            local_shape=shape, stacked=item.stacked, dtype=dtype, produce=produce,
            allow_shape_mismatch=item.rule.vocab_rows, nbytes=_numel(shape) * dtype.itemsize,
            scratch_bytes=scratch, expert_axis=item.rule.per_expert))
    return shards


CAST_CHUNK_BYTES = 32 * 2**20


def _producer(reader: safetensors_io.SafetensorsReader, item: Item, dims: Dims,
              dtype: torch.dtype) -> tuple[Any, int]:
    """(produce(out, scratch), scratch bytes): produce fills `out` (the Megatron tensor) from the
    Hugging Face tensors, reading each row block straight into its place (or, for a dtype change,
    through `scratch` chunk by chunk, converting with copy_)."""
    names = item.hf_names
    shape = dims.shape(item.rule.mcore_shape)
    hf_rows = [reader.tensors[n].shape[0] if reader.tensors[n].shape else 1 for n in names]
    blocks = transforms.blocks(item.rule.transform, dims, hf_rows, shape[0] if shape else 1)
    sources = [safetensors_io.torch_dtype(reader.tensors[n].dtype) for n in names]
    direct = all(d == dtype for d in sources)

    def chunk_rows(source: int) -> int:
        return max(1, CAST_CHUNK_BYTES // max(1, reader.row_bytes(names[source])))

    scratch_bytes = 0 if direct else max(
        (min(b.rows, chunk_rows(b.source)) * reader.row_bytes(names[b.source]) for b in blocks), default=0)

    def produce(out: torch.Tensor, scratch: torch.Tensor | None) -> None:
        rows = out.view(shape[0] if shape else 1, -1)
        covered = [False] * rows.shape[0]
        for b in blocks:
            name = names[b.source]
            if direct:
                reader.read_rows_into(name, b.start, b.rows, safetensors_io.byte_view(rows[b.dest:b.dest + b.rows]))
            else:
                assert scratch is not None
                row, step = reader.row_bytes(name), chunk_rows(b.source)
                for r0 in range(0, b.rows, step):
                    n = min(step, b.rows - r0)
                    part = scratch[:n * row]
                    reader.read_rows_into(name, b.start + r0, n, safetensors_io.byte_view(part))
                    rows[b.dest + r0:b.dest + r0 + n].copy_(part.view(sources[b.source]).view(n, -1))
            covered[b.dest:b.dest + b.rows] = [True] * b.rows
        first_gap = covered.index(False) if not all(covered) else None
        if first_gap is not None:  # vocabulary padding: zero rows (the buffer holds an earlier tensor)
            rows[first_gap:].zero_()

    return produce, scratch_bytes


def _copy_assets(src: Path, dst: Path) -> None:
    present = [src / n for n in ASSET_FILES if (src / n).is_file()] + [src / "config.json"]
    dst.mkdir(parents=True, exist_ok=True)
    for path in present:
        shutil.copy2(path, dst / path.name)


# ----------------------------------------------------------------------------------- Megatron -> HF
