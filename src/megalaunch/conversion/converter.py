"""The two conversions, streaming tensor group by tensor group.

hf_to_mcore: Hugging Face safetensors -> Megatron-core torch_dist checkpoint (`release` or iter_N).
mcore_to_hf: a complete Megatron-core checkpoint (a run, its checkpoints/ or an iteration directory)
             -> Hugging Face safetensors + config.json in the checkpoint's dtype.

Both work one Megatron tensor at a time (its sources: a layer's q/k/v, gate/up, ...): mcore_to_hf
one after the other, hf_to_mcore several at once on a few threads under a byte budget for the tensors
in flight (1.5x the largest tensor group by default). Peak memory stays near the largest tensor group
(the embedding for most models) instead of the model."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.config.schema import ModelConfig
from megalaunch.conversion import families, mcore_io, safetensors_io, transforms
from megalaunch.conversion.dims import Dims, padded_vocab_size
from megalaunch.conversion.errors import ConversionError, MissingFileError, ShapeMismatchError
from megalaunch.conversion.progress import Progress
from megalaunch.conversion.tables import EXTRA_STATE_MODULES, IGNORED_HF_SUFFIXES, TABLES, Item, items

if TYPE_CHECKING:
    import torch

CONVERSION_KEY = "megalaunch_conversion"
ASSETS_DIR = "hf_assets"
# hf-to-mcore: writer threads, and the default budget for the bytes of tensors in flight (a multiple
# of the largest tensor group: room for the largest one plus smaller ones alongside it).
DEFAULT_THREADS = 4
INFLIGHT_FACTOR = 1.5
# Files that travel with the weights: tokenizer and generation settings.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@dataclass
class Report:
    """What a conversion did (printed by the CLI, measured by the benchmark)."""

    output: Path
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    largest_group_bytes: int = 0
    threads: int = 1
    max_inflight_bytes: int = 0
    """hf-to-mcore: the byte budget for tensors in flight."""
    peak_inflight_bytes: int = 0
    """hf-to-mcore: most bytes of tensors in flight at once (<= max_inflight_bytes unless one tensor is larger)."""
    notes: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    if name in (None, "", "auto"):
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = getattr(torch, aliases.get(name, name), None)
    if not isinstance(value, torch.dtype):
        raise ConversionError(f"dtype {name!r}", field="--dtype", valid="bfloat16, float16, float32, auto")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist", fix="point at a Hugging Face model directory")
    return dict(json.loads(path.read_text()))


def _stacked_shape(item: Item, dims: Dims) -> tuple[int, ...]:
    shape = dims.shape(item.rule.mcore_shape)
    return (dims.num_layers, *shape) if item.rule.per_layer else shape


def _hf_shapes(item: Item, dims: Dims) -> list[tuple[int, ...]]:
    return [dims.shape(s) for s in item.rule.hf_shapes]


def largest_group_bytes(work: list[Item], dims: Dims, element_size: int) -> int:
    """Bytes of the largest tensor group converted together: the embedding (or output layer) on its own,
    or one transformer layer. Peak memory is bounded by about twice this."""
    sizes: dict[object, int] = {}
    for item in work:
        group = item.layer if item.rule.per_layer else item.rule.mcore
        sizes[group] = sizes.get(group, 0) + _numel(dims.shape(item.rule.mcore_shape)) * element_size
    return max(sizes.values())


def _prepare_output(out: Path, iteration: int | None, overwrite: bool) -> Path:
    target = out / mcore_io.iteration_dir_name(iteration)
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise ConversionError(f"{target} already exists and is not empty",
                                  fix="choose another --out, or pass --overwrite")
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    return target


# ----------------------------------------------------------------------------------- HF -> Megatron


def megatron_args(model: ModelConfig, dims: Dims, *, tensor_parallel: int, iteration: int,
                  dtype: torch.dtype) -> argparse.Namespace:
    """The `args` Megatron stores in a checkpoint, so `--use-checkpoint-args` and the resume checks work,
    and so a later mcore-to-hf knows the model. no_save_optim/no_save_rng: there is no optimizer state."""
    import torch

    return argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=dims.ffn,
        num_attention_heads=model.num_attention_heads, num_query_groups=dims.groups,
        group_query_attention=dims.groups != dims.heads, kv_channels=dims.head_dim,
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
    )


def check_hf_tensors(reader: safetensors_io.SafetensorsReader, table: Any, dims: Dims, source: Path) -> None:
    """Every tensor the mapping needs exists with the expected shape; nothing is silently left behind."""
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
             and not (dims.tied and n == "lm_head.weight")]
    if extra:
        raise ConversionError(f"{len(extra)} tensors have no mapping, e.g. '{extra[0]}'",
                              fix="this model has parts the Llama-family mapping does not cover")


def hf_to_mcore(hf_dir: Path, out: Path, *, model: ModelConfig | None = None, vocab_size: int | None = None,
                tensor_parallel: int = 1, iteration: int | None = None, dtype: str | None = None,
                threads: int = DEFAULT_THREADS, max_inflight_bytes: int | None = None, overwrite: bool = False,
                progress: bool = True, fsync: bool = False, crc32: bool = False) -> Report:
    """Convert a Hugging Face Llama-family model into a Megatron-core checkpoint under `out`.

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
    if not hf_dir.is_dir():
        raise MissingFileError(f"{hf_dir} is not a directory")
    hf_cfg = _read_json(hf_dir / "config.json")
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
    table = TABLES[hf.family]
    report = Report(output=out, notes=list(hf.notes))
    cast = _dtype(dtype)

    with safetensors_io.SafetensorsReader(hf_dir) as reader:
        check_hf_tensors(reader, table, dims, hf_dir)
        work = list(items(table, dims))
        stored = {n: safetensors_io.torch_dtype(i.dtype) for n, i in reader.tensors.items()}
        out_dtype = cast or stored[work[0].hf_names[0]]
        shards = []
        element_size = out_dtype.itemsize
        for item in work:
            shape = dims.shape(item.rule.mcore_shape)
            produce, scratch = _producer(reader, item, dims, out_dtype)
            shards.append(mcore_io.LazyShard(
                key=item.rule.mcore, global_shape=_stacked_shape(item, dims),
                offset=_offset(item, len(shape)),
                local_shape=shape, stacked=item.rule.per_layer, dtype=out_dtype,
                produce=produce, allow_shape_mismatch=item.rule.vocab_rows,
                nbytes=_numel(shape) * element_size, scratch_bytes=scratch))
        report.tensors = len(shards)
        report.bytes = sum(s.nbytes for s in shards)
        report.largest_group_bytes = largest_group_bytes(work, dims, element_size)
        if max_inflight_bytes is not None and max_inflight_bytes <= 0:
            raise ConversionError(f"max in-flight bytes {max_inflight_bytes}", field="--max-inflight-gb",
                                  valid="a positive size")
        budget = max_inflight_bytes or int(INFLIGHT_FACTOR * report.largest_group_bytes)
        target = _prepare_output(out, iteration, overwrite)
        common = {
            "args": megatron_args(model, dims, tensor_parallel=tensor_parallel, iteration=iteration or 0,
                                  dtype=out_dtype),
            "checkpoint_version": 3.0,
            "iteration": iteration or 0,
            CONVERSION_KEY: {"version": 1, "family": hf.family, "hf_config": hf_cfg, "source": str(hf_dir),
                             "vocab_size": hf.vocab_size},
        }
        bar = Progress(report.bytes, f"hf-to-mcore {target.name}", progress)
        start = time.perf_counter()
        with mcore_io.process_group():
            stats = mcore_io.save(target, shards, common, max_inflight_bytes=budget, threads=max(1, threads),
                                  extra_state=EXTRA_STATE_MODULES, num_layers=dims.num_layers, fsync=fsync,
                                  crc32=crc32, on_written=lambda s: bar.update(s.nbytes))
        bar.close()
        report.seconds = time.perf_counter() - start
        report.threads = stats.threads
        report.max_inflight_bytes = stats.max_inflight_bytes
        report.peak_inflight_bytes = stats.peak_inflight_bytes
    mcore_io.write_tracker(out, iteration)
    _copy_assets(hf_dir, out / ASSETS_DIR)
    report.output = target
    return report


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Staging:
    """One reusable buffer (mcore-to-hf reads each Megatron tensor into it and writes it out before
    reading the next, so fresh pages are not faulted in for every tensor)."""

    buffer: torch.Tensor | None = None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> torch.Tensor:
        import torch

        if self.buffer is None:
            # torch.empty leaves the pages untouched until used (a bytearray zeroes all of them)
            self.buffer = torch.empty(capacity, dtype=torch.uint8)
        nbytes = _numel(shape) * dtype.itemsize
        return self.buffer[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


# A dtype conversion (--dtype) reads the source rows through a scratch buffer of at most this size.
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


def model_from_megatron_args(args: Any) -> ModelConfig:
    """The ModelConfig a Megatron checkpoint was trained with, from the `args` it stores."""
    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    groups = get("num_query_groups") if get("group_query_attention", False) else None
    return ModelConfig(
        num_layers=get("num_layers"), hidden_size=get("hidden_size"), ffn_hidden_size=get("ffn_hidden_size"),
        num_attention_heads=get("num_attention_heads"), num_query_groups=groups or get("num_attention_heads"),
        seq_length=get("seq_length") or 2048, max_position_embeddings=get("max_position_embeddings") or 2048,
        position_embedding_type=get("position_embedding_type", "rope"), rotary_base=int(get("rotary_base", 10000)),
        rotary_percent=float(get("rotary_percent", 1.0)), use_rope_scaling=bool(get("use_rope_scaling", False)),
        rope_scaling_factor=float(get("rope_scaling_factor", 8.0)),
        normalization=get("normalization", "RMSNorm"), norm_epsilon=float(get("norm_epsilon", 1e-5)),
        swiglu=bool(get("swiglu", False)), disable_bias_linear=not get("add_bias_linear", True),
        add_qkv_bias=bool(get("add_qkv_bias", False)),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
        num_experts=get("num_experts"), make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
    )


def _tokenizer_vocab(args: Any) -> int | None:
    """Megatron's tokenizer size: NullTokenizer's --vocab-size, or a Hugging Face tokenizer's length."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    path = getattr(args, "tokenizer_model", None)
    if getattr(args, "tokenizer_type", None) == "HuggingFaceTokenizer" and path and Path(path).exists():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(path))
    return None


@dataclass(frozen=True)
class _Source:
    hf_cfg: dict[str, Any]
    assets: Path | None
    notes: tuple[str, ...]


def _hf_source(ref: mcore_io.CheckpointRef, common: dict[str, Any], *, hf_template: Path | None,
               family: str | None, model: ModelConfig | None, vocab_size: int | None,
               padded_rows: int, dtype: torch.dtype) -> _Source:
    """Which Hugging Face config describes this checkpoint: --hf-template, else the one hf-to-mcore
    stored in the checkpoint, else one written from the model (recipe or the checkpoint's args)."""
    stored = common.get(CONVERSION_KEY) or {}
    args = common.get("args")
    notes: list[str] = []
    if hf_template is not None:
        cfg = _read_json(Path(hf_template) / "config.json")
        return _Source(cfg, Path(hf_template), ())
    root_assets = ref.path.parent / ASSETS_DIR
    if stored.get("hf_config"):
        return _Source(dict(stored["hf_config"]), root_assets if root_assets.is_dir() else None, ())
    if model is None:
        if args is None:
            raise ConversionError(f"{ref.path} carries no model arguments",
                                  fix="pass --recipe (the model it was trained with) or --hf-template HF_DIR")
        model = model_from_megatron_args(args)
    vocab = vocab_size or (_tokenizer_vocab(args) if args is not None else None)
    if vocab is None:
        vocab = padded_rows
        notes.append(f"vocabulary size unknown: kept all {padded_rows} rows (pass --vocab-size to strip padding)")
    fam = family or ("qwen2" if model.add_qkv_bias else "llama")
    cfg = families.hf_config_from_model(model, family=fam, vocab_size=vocab, dtype=str(dtype).removeprefix("torch."))
    return _Source(cfg, root_assets if root_assets.is_dir() else None, tuple(notes))


def mcore_to_hf(checkpoint: Path, out: Path, *, iteration: int | None = None, hf_template: Path | None = None,
                family: str | None = None, model: ModelConfig | None = None, vocab_size: int | None = None,
                dtype: str | None = None, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
                progress: bool = True, fsync: bool = False) -> Report:
    """Convert a complete Megatron-core checkpoint into a Hugging Face directory `out`."""
    out = Path(out)
    ref = mcore_io.resolve(Path(checkpoint), iteration)
    if out.exists() and any(out.glob("*.safetensors")) and not overwrite:
        raise ConversionError(f"{out} already holds safetensors files", fix="choose another --out, or --overwrite")
    with mcore_io.process_group():
        common = mcore_io.load_common(ref.path)
        meta = mcore_io.tensors_metadata(ref.path)
        embed = meta.get("embedding.word_embeddings.weight")
        if embed is None:
            raise ConversionError(f"{ref.path} has no embedding.word_embeddings.weight: not a GPT checkpoint "
                                  "(or a pipeline stage without the embedding)")
        padded_rows = int(embed.global_shape[0])
        out_dtype = _dtype(dtype) or embed.dtype
        source = _hf_source(ref, common, hf_template=hf_template, family=family, model=model,
                            vocab_size=vocab_size, padded_rows=padded_rows, dtype=out_dtype)
        hf = families.model_from_hf_config(source.hf_cfg)
        args = common.get("args")
        ckpt_model = model or (model_from_megatron_args(args) if args is not None else None)
        if ckpt_model is not None:
            diffs = families.differences(ckpt_model, hf.model)
            if diffs:
                text = "; ".join(f"{n}: checkpoint {a!r}, Hugging Face {b!r}" for n, a, b in diffs)
                raise ConversionError(f"the Hugging Face config does not describe this checkpoint: {text}")
        dims = Dims.from_model(hf.model, vocab=hf.vocab_size, padded_vocab=max(padded_rows, hf.vocab_size))
        table = TABLES[hf.family]
        work = list(items(table, dims))
        _check_mcore_tensors(meta, work, dims, ref.path)
        report = Report(output=out, notes=list(hf.notes) + list(source.notes),
                        largest_group_bytes=largest_group_bytes(work, dims, out_dtype.itemsize))
        plan: list[tuple[str, str, tuple[int, ...]]] = []
        code = safetensors_io.dtype_code(out_dtype)
        for item in work:
            shapes = [(dims.vocab, *s[1:]) if item.rule.vocab_rows else s for s in _hf_shapes(item, dims)]
            plan += [(n, code, s) for n, s in zip(item.hf_names, shapes, strict=True)]
        out.mkdir(parents=True, exist_ok=True)
        writer = safetensors_io.SafetensorsWriter(out, plan, max_shard_bytes=max_shard_bytes)
        bar = Progress(writer.total_bytes, f"mcore-to-hf {ref.path.name}", progress)
        start = time.perf_counter()
        try:
            staging = _Staging()
            requests = [_request(item, dims, meta) for item in work]
            capacity = max(_numel(r.local_shape) * r.dtype.itemsize for r in requests)
            with mcore_io.DirectReader(ref.path) as reader:
                for item, r in zip(work, requests, strict=True):
                    target = staging.tensor(((1,) if r.stacked else ()) + r.local_shape, r.dtype, capacity)
                    reader.read_into(r.key, r.offset, target)
                    tensor = target[0] if r.stacked else target
                    tensor = tensor if tensor.dtype == out_dtype else tensor.to(out_dtype)
                    rows = tensor.view(tensor.shape[0] if tensor.dim() else 1, -1)
                    hf_rows = [writer.slots[n].shape[0] if writer.slots[n].shape else 1 for n in item.hf_names]
                    for b in transforms.blocks(item.rule.transform, dims, hf_rows, rows.shape[0]):
                        name = item.hf_names[b.source]
                        block = rows[b.dest:b.dest + b.rows].view(b.rows, *writer.slots[name].shape[1:])
                        writer.write_rows(name, b.start, block)
                        bar.update(block.numel() * block.element_size())
                    for name in item.hf_names:
                        writer.done(name)
                        report.bytes += writer.slots[name].nbytes
                        report.tensors += 1
            writer.close(sync=fsync)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        report.seconds = time.perf_counter() - start
    _write_hf_metadata(out, source, out_dtype)
    return report


def _request(item: Item, dims: Dims, meta: dict[str, Any]) -> mcore_io.ShardRequest:
    info = meta[item.rule.mcore]
    shape = tuple(int(d) for d in info.global_shape)
    local = shape[1:] if item.rule.per_layer else shape
    return mcore_io.ShardRequest(item.rule.mcore, shape, _offset(item, len(local)), local, item.rule.per_layer,
                                 info.dtype)


def _offset(item: Item, ndim: int) -> tuple[int, ...]:
    """Global offset of one item: its layer on the stacked axis, then zeros."""
    layer = (item.layer or 0,) if item.rule.per_layer else ()
    return layer + (0,) * ndim


def _check_mcore_tensors(meta: dict[str, Any], work: list[Item], dims: Dims, ckpt: Path) -> None:
    seen: set[str] = set()
    for item in work:
        key = item.rule.mcore
        if key in seen:
            continue
        seen.add(key)
        info = meta.get(key)
        if info is None:
            hint = " (saved with singleton_local_shards?)" if f"{key}_w" in meta else ""
            raise ConversionError(f"tensor '{key}' is missing from {ckpt}{hint}",
                                  fix="the checkpoint does not match the model configuration (tied embeddings? "
                                      "QKV bias?)")
        found = tuple(int(d) for d in info.global_shape)
        expected = _stacked_shape(item, dims)
        if item.rule.vocab_rows:
            found, expected = found[1:], expected[1:]
        if found != expected:
            raise ShapeMismatchError(key, found, expected, source=f"Megatron checkpoint {ckpt.name}")


def _write_hf_metadata(out: Path, source: _Source, dtype: torch.dtype) -> None:
    cfg = dict(source.hf_cfg)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / "config.json")
    if source.assets is not None:
        for n in ASSET_FILES:
            if (source.assets / n).is_file():
                shutil.copy2(source.assets / n, out / n)
