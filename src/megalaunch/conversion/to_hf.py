"""A complete Megatron-core checkpoint (a run, its checkpoints/ or an iteration directory) -> Hugging
Face safetensors + config.json, one tensor group after the other (converter.py has the shared parts)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.config.schema import ModelConfig
from megalaunch.config.tokenizer import TOKENIZER_FILES, TokenizerSpec, resolve_tokenizer
from megalaunch.conversion import families, transforms
from megalaunch.conversion.checkpoint_io import fsdp_layout, mcore_dist, mcore_layout, safetensors_io
from megalaunch.conversion.checkpoint_io.mcore_direct import DirectReader
from megalaunch.conversion.checkpoint_io.progress import Progress
from megalaunch.conversion.converter import (
    ASSET_FILES,
    ASSETS_DIR,
    CONVERSION_KEY,
    Report,
    _dtype,
    _hf_shapes,
    _numel,
    _offset,
    _read_json,
    _stacked_shape,
    _Staging,
    largest_group_bytes,
)
from megalaunch.conversion.dims import Dims
from megalaunch.conversion.errors import ConversionError, ShapeMismatchError
from megalaunch.conversion.families_deepseek import mla_from_megatron_args
from megalaunch.conversion.families_moe import moe_from_megatron_args
from megalaunch.conversion.tables import TABLES, Item, items
from megalaunch.errors import PreflightError
from megalaunch.runtime.checkpoint.completeness import is_fsdp_dtensor

if TYPE_CHECKING:
    import torch

def model_from_megatron_args(args: Any) -> ModelConfig:
    """The ModelConfig a Megatron checkpoint was trained with, from the `args` it stores."""
    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    groups = get("num_query_groups") if get("group_query_attention", False) else None
    kv_channels = get("kv_channels")  # Megatron stores hidden / heads when --kv-channels was not given
    if kv_channels and get("hidden_size") and kv_channels * get("num_attention_heads") == get("hidden_size"):
        kv_channels = None
    return ModelConfig(
        num_layers=get("num_layers"), hidden_size=get("hidden_size"), ffn_hidden_size=get("ffn_hidden_size"),
        num_attention_heads=get("num_attention_heads"), num_query_groups=groups or get("num_attention_heads"),
        seq_length=get("seq_length") or 2048, max_position_embeddings=get("max_position_embeddings") or 2048,
        position_embedding_type=get("position_embedding_type", "rope"), rotary_base=int(get("rotary_base", 10000)),
        rotary_percent=float(get("rotary_percent", 1.0)), use_rope_scaling=bool(get("use_rope_scaling", False)),
        rope_scaling_factor=float(get("rope_scaling_factor", 8.0)),
        normalization=get("normalization", "RMSNorm"),
        norm_epsilon=float(get("layernorm_epsilon", get("norm_epsilon", 1e-5))),  # Megatron's dest of --norm-epsilon
        swiglu=bool(get("swiglu", False)), disable_bias_linear=not get("add_bias_linear", True),
        add_qkv_bias=bool(get("add_qkv_bias", False)),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
        make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
        kv_channels=None if get("multi_latent_attention", False) else kv_channels,
        qk_layernorm=bool(get("qk_layernorm", False)), **moe_from_megatron_args(get), **mla_from_megatron_args(get),
    )


def run_tokenizer(ckpt: Path, args: Any) -> TokenizerSpec | None:
    """The tokenizer a checkpoint was trained with: its run's frozen RUN/tokenizer/ (ckpt is
    RUN/checkpoints/iter_N), else the checkpoint's --tokenizer-model; None for the NullTokenizer or
    when neither exists any more."""
    candidates = [ckpt.parent.parent / "tokenizer"]
    if getattr(args, "tokenizer_type", None) == "HuggingFaceTokenizer" and getattr(args, "tokenizer_model", None):
        candidates.append(Path(args.tokenizer_model))
    for path in candidates:
        if path.exists():
            return resolve_tokenizer(path, field_name="--hf-template")
    return None


def _tokenizer_vocab(args: Any, tokenizer: TokenizerSpec | None) -> int | None:
    """Megatron's tokenizer size: NullTokenizer's --vocab-size, or the Hugging Face tokenizer's entries."""
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return tokenizer.vocab_size if tokenizer is not None else None


@dataclass(frozen=True)
class _Source:
    hf_cfg: dict[str, Any]
    assets: Path | None
    notes: tuple[str, ...]
    tokenizer: TokenizerSpec | None = None
    """Tokenizer files written into the output (over `assets`), special-token ids into config.json."""
    generated: bool = False
    """hf_cfg was written from the model (it names no special tokens of its own)."""


def _template_tokenizer(template: Path) -> TokenizerSpec:
    """A --hf-template without config.json: a tokenizer directory, used for the tokenizer only."""
    if not any((template / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise ConversionError(f"--hf-template {template} has no config.json and no tokenizer files",
                              valid="a Hugging Face model directory (config.json) or a tokenizer directory "
                                    "(tokenizer.json)", fix="point --hf-template at one, or leave it out")
    return resolve_tokenizer(template, field_name="--hf-template")


def _hf_source(ref: mcore_layout.CheckpointRef, common: dict[str, Any], *, hf_template: Path | None,
               family: str | None, model: ModelConfig | None, vocab_size: int | None,
               padded_rows: int, dtype: torch.dtype) -> _Source:
    """Which Hugging Face config describes this checkpoint: --hf-template, else the one hf-to-mcore
    stored in the checkpoint, else one written from the model (recipe or the checkpoint's args).
    The tokenizer: a tokenizer-only --hf-template, else the run's own (run_tokenizer)."""
    stored = common.get(CONVERSION_KEY) or {}
    args = common.get("args")
    notes: list[str] = []
    tokenizer: TokenizerSpec | None = None
    template = Path(hf_template) if hf_template is not None else None
    has_tokenizer = template is not None and any((template / n).is_file() for n in TOKENIZER_FILES)
    if template is not None and not (template / "config.json").is_file():
        tokenizer = _template_tokenizer(template)
    elif not has_tokenizer:
        try:
            tokenizer = run_tokenizer(ref.path, args)
        except PreflightError as e:
            notes.append(f"the run's tokenizer is not copied: {e}")
    if template is not None and (template / "config.json").is_file():
        return _Source(_read_json(template / "config.json"), template, tuple(notes), tokenizer)
    root_assets = ref.path.parent / ASSETS_DIR
    if stored.get("hf_config"):
        return _Source(dict(stored["hf_config"]), root_assets if root_assets.is_dir() else None, tuple(notes),
                       tokenizer)
    if model is None:
        if args is None:
            raise ConversionError(f"{ref.path} carries no model arguments",
                                  fix="pass --recipe (the model it was trained with) or --hf-template HF_DIR")
        model = model_from_megatron_args(args)
    vocab = vocab_size or (_tokenizer_vocab(args, tokenizer) if args is not None else None) \
        or (tokenizer.vocab_size if tokenizer is not None else None)
    if vocab is None:
        vocab = padded_rows
        notes.append(f"vocabulary size unknown: kept all {padded_rows} rows (pass --vocab-size to strip padding)")
    fam = family or _family(model)
    cfg = families.hf_config_from_model(model, family=fam, vocab_size=vocab, dtype=str(dtype).removeprefix("torch."))
    return _Source(cfg, root_assets if root_assets.is_dir() else None, tuple(notes), tokenizer, generated=True)


def _family(model: ModelConfig) -> str:
    """The family a model without a Hugging Face config is written as: by its QKV bias, QK-norm and, for a
    mixture of experts, its shared expert."""
    if model.multi_latent_attention:
        return "deepseek_v3"
    if model.num_experts:
        return "qwen2_moe" if model.moe_shared_expert_intermediate_size else \
            "qwen3_moe" if model.qk_layernorm else "mixtral"
    return "qwen2" if model.add_qkv_bias else "qwen3" if model.qk_layernorm else "llama"


def mcore_to_hf(checkpoint: Path, out: Path, *, iteration: int | None = None, hf_template: Path | None = None,
                family: str | None = None, model: ModelConfig | None = None, vocab_size: int | None = None,
                dtype: str | None = None, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
                progress: bool = True, fsync: bool = False) -> Report:
    """Convert a complete Megatron-core checkpoint into a Hugging Face directory `out`."""
    out = Path(out)
    ref = mcore_layout.resolve(Path(checkpoint), iteration)
    if out.exists() and any(out.glob("*.safetensors")) and not overwrite:
        raise ConversionError(f"{out} already holds safetensors files", fix="choose another --out, or --overwrite")
    with mcore_dist.process_group(), contextlib.ExitStack() as stack:
        if is_fsdp_dtensor(ref.path):  # Megatron-FSDP's format: its weights as torch_dist first
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".fsdp-weights-", dir=out.parent)))
            fsdp_layout.to_torch_dist(ref.path, tmp / ref.path.name)
            ref = mcore_layout.CheckpointRef(tmp / ref.path.name, ref.iteration)
        common = mcore_dist.load_common(ref.path)
        meta = mcore_dist.tensors_metadata(ref.path)
        embed = meta.get("embedding.word_embeddings.weight")
        if embed is None:
            raise ConversionError(f"{ref.path} has no embedding.word_embeddings.weight: not a GPT checkpoint "
                                  "(or a pipeline stage without the embedding)")
        padded_rows = int(embed.global_shape[0])
        out_dtype = _dtype(dtype) or embed.dtype
        source = _hf_source(ref, common, hf_template=hf_template, family=family, model=model,
                            vocab_size=vocab_size, padded_rows=padded_rows, dtype=out_dtype)
        hf = families.model_from_hf_config(source.hf_cfg)
        _check_described(model, common.get("args"), hf)
        dims = Dims.from_model(hf.model, vocab=hf.vocab_size, padded_vocab=max(padded_rows, hf.vocab_size))
        table = TABLES[hf.family]
        work = list(items(table, dims))
        _check_mcore_tensors(meta, work, dims, ref.path)
        _check_all_mapped(meta, work, dims, ref.path, hf.family)
        report = Report(output=out, notes=list(hf.notes) + list(source.notes),
                        largest_group_bytes=largest_group_bytes(work, dims, out_dtype.itemsize))
        plan: list[tuple[str, str, tuple[int, ...]]] = []
        code = safetensors_io.dtype_code(out_dtype)
        for item in work:  # a tensor of its own dtype (DeepSeek's router) is written in the checkpoint's
            shapes = [(dims.vocab, *s[1:]) if item.rule.vocab_rows else s for s in _hf_shapes(item, dims)]
            own = safetensors_io.dtype_code(meta[item.key].dtype) if item.rule.own_dtype else code
            plan += [(n, own, s) for n, s in zip(item.hf_names, shapes, strict=True)]
        out.mkdir(parents=True, exist_ok=True)
        writer = safetensors_io.SafetensorsWriter(out, plan, max_shard_bytes=max_shard_bytes)
        bar = Progress(writer.total_bytes, f"mcore-to-hf {ref.path.name}", progress)
        start = time.perf_counter()
        try:
            _copy_tensors(ref.path, work, dims, meta, writer, out_dtype, bar, report)
            writer.close(sync=fsync)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        report.seconds = time.perf_counter() - start
    _write_hf_metadata(out, source, out_dtype)
    return report


def _check_described(model: ModelConfig | None, args: Any, hf: families.HFModel) -> None:
    """The Hugging Face config must describe the checkpoint's model (the recipe's, or its own args)."""
    ckpt_model = model or (model_from_megatron_args(args) if args is not None else None)
    if ckpt_model is None:
        return
    diffs = families.differences(ckpt_model, hf.model)
    if diffs:
        text = "; ".join(f"{n}: checkpoint {a!r}, Hugging Face {b!r}" for n, a, b in diffs)
        raise ConversionError(f"the Hugging Face config does not describe this checkpoint: {text}")


def _copy_tensors(ckpt: Path, work: list[Item], dims: Dims, meta: dict[str, Any],
                  writer: safetensors_io.SafetensorsWriter, out_dtype: torch.dtype, bar: Progress,
                  report: Report) -> None:
    """Each Megatron tensor read into one reused staging buffer, cast, and written as the row blocks
    of its Hugging Face tensors."""
    staging = _Staging()
    requests = [_request(item, dims, meta) for item in work]
    capacity = max(_numel(r.local_shape) * r.dtype.itemsize for r in requests)
    with DirectReader(ckpt) as reader:
        for item, r in zip(work, requests, strict=True):
            lead = len(r.global_shape) - len(r.local_shape)  # the stacked layer (and expert) axes
            target = staging.tensor((1,) * lead + r.local_shape, r.dtype, capacity)
            reader.read_into(r.key, r.offset, target)  # a routed expert: from whichever EP rank saved it
            tensor = target.view(r.local_shape)
            want = r.dtype if item.rule.own_dtype else out_dtype
            tensor = tensor if tensor.dtype == want else tensor.to(want)
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


def _request(item: Item, dims: Dims, meta: dict[str, Any]) -> mcore_dist.ShardRequest:
    info = meta[item.key]
    shape = tuple(int(d) for d in info.global_shape)
    local = shape[int(item.stacked) + int(item.rule.per_expert):]  # without the layer (and expert) axes
    return mcore_dist.ShardRequest(item.key, shape, _offset(item, len(local)), local, item.stacked, info.dtype)


def _check_mcore_tensors(meta: dict[str, Any], work: list[Item], dims: Dims, ckpt: Path) -> None:
    seen: set[str] = set()
    for item in work:
        key = item.key
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


def _check_all_mapped(meta: dict[str, Any], work: list[Item], dims: Dims, ckpt: Path, family: str) -> None:
    """Every model tensor of the checkpoint is written somewhere: one the Hugging Face config has no place for
    (a shared expert under a Mixtral config, a bias under Llama's) is refused, not dropped."""
    mapped = {item.key for item in work}
    model_keys = [k for k in meta if k.startswith(("embedding.", "decoder.", "output_layer."))
                  and not k.endswith("_extra_state") and k not in mapped
                  and not (dims.tied and k == "output_layer.weight")]
    if model_keys:
        raise ConversionError(f"tensor '{model_keys[0]}' of {ckpt} has no place in the Hugging Face {family} model "
                              f"({len(model_keys)} such tensors)",
                              fix="pass --family or --hf-template for the model the checkpoint holds")


def _write_hf_metadata(out: Path, source: _Source, dtype: torch.dtype) -> None:
    cfg = dict(source.hf_cfg)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    if source.tokenizer is not None:  # a generated config names no tokens; a given one keeps its own
        for key, value in source.tokenizer.hf_config_ids().items():
            if source.generated or cfg.get(key) is None:
                cfg[key] = value
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / "config.json")
    if source.assets is not None:
        for n in ASSET_FILES:
            if (source.assets / n).is_file():
                shutil.copy2(source.assets / n, out / n)
    if source.tokenizer is not None:
        for n, content in source.tokenizer.files().items():
            (out / f"{n}.tmp").write_bytes(content)
            (out / f"{n}.tmp").replace(out / n)
