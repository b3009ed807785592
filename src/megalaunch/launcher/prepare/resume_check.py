"""What `megalaunch resume RUN [--set KEY=VALUE ...]` checks before it queues, and how it changes a
run's settings (docs/training.md, "Resume").

Before any job is queued: the same preflight as `submit` (on the run's frozen blend, or on the new
one a `--set` names), and three refusals, each one line: the run already reached
`training.train_iters`; RUN/data_blend.txt differs from the blend the checkpoints were trained on and
no `resume --set` recorded the change; the chain needs a checkpoint that is gone (the tracker names
one but `checkpoints/` holds none, or `checkpoint.load` is missing before the first checkpoint).

`--set` loads run.yaml (keeping where each value came from), applies the overrides, validates and
renders everything in memory; only then are the run's files replaced (each atomically, keeping its
mode), the change recorded in the ledger (`settings_changed`: each key's old and new value, the old
and new blend and recipe sha256, who, when) and in manifest.json (`changes`)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from megalaunch.config.loader import LoadedRecipe, apply_sets, load_run_recipe, parse_set, read_run_tree
from megalaunch.config.paths import expand_paths
from megalaunch.config.planner.auto import with_layout
from megalaunch.config.schema import Recipe
from megalaunch.config.typed import build, to_plain
from megalaunch.errors import ConfigError, RunDirError
from megalaunch.launcher.prepare.explain import origins_from
from megalaunch.launcher.prepare.prepare import PreparedRun, prepare_run
from megalaunch.rundir.files import atomic_write_json, atomic_write_text, read_json
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import (
    blend_change_refusal,
    blend_hash,
    checkpoint_iterations,
    unapproved_blend_change,
)

FIXED_KEYS = ("name", "run")  # they name the run directory, its chain and its group: a new submit
DATA_KEYS = ("data.blend", "data.blend_file", "data.mock")


@dataclass(frozen=True)
class SettingsChange:
    """A validated `resume --set`: the run's new files and what changed."""

    prepared: PreparedRun
    changes: list[dict[str, Any]]  # {"key", "old", "new"} per --set
    blend_sha256: dict[str, str | None]  # {"old", "new"}
    recipe_sha256: dict[str, str | None]
    data_changed: bool  # a data key changed: the blend is resolved anew, the frozen file replaced


def _frozen_blend(paths: RunPaths) -> Any | None:
    from megalaunch.data.blend import Blend

    return Blend.read(paths.data_blend) if paths.data_blend.is_file() else None


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _check_keys(sets: list[str]) -> list[str]:
    keys = []
    for expr in sets:
        parts, _ = parse_set(expr)
        if parts[0] in FIXED_KEYS:
            raise ConfigError(f"{'.'.join(parts)} cannot change on resume: it names the run directory, its "
                              "chain or its group", field=f"--set {'.'.join(parts)}",
                              fix="submit the recipe again as a new run")
        keys.append(".".join(parts))
    return keys


def prepare_change(paths: RunPaths, sets: list[str]) -> SettingsChange:
    """Validate `sets` against the run like `submit` would; writes nothing."""
    keys = _check_keys(sets)
    tree = read_run_tree(paths)
    old_plain = to_plain(load_run_recipe(paths))
    prov = origins_from(paths.run_yaml.read_text(), tree)
    apply_sets(tree, sets, prov)
    for k in list(prov):
        if any(k == key or k.startswith(key + ".") for key in keys):
            prov[k] = "megalaunch resume --set"
    recipe = expand_paths(build(Recipe, tree))
    layout = None  # the layout the checkpoints were written with stays, unless --set parallel=auto asks anew
    if any(k in ("parallel", "parallel.layout") for k in keys) and recipe.parallel.layout == "auto":
        recipe, layout = with_layout(recipe, tree, prov)
    _check_expert_layout(paths, old_plain, recipe)
    manifest = read_json(paths.manifest) or {}
    loaded = LoadedRecipe(recipe=recipe, raw=tree, provenance=prov, source=str(manifest.get("recipe_source", "")),
                          layout=layout)
    new_plain = to_plain(recipe)
    data_changed = any(_lookup(old_plain, k) != _lookup(new_plain, k) for k in DATA_KEYS)
    frozen = None if data_changed else _frozen_blend(paths)
    prepared = prepare_run(_without_spent_load(paths, loaded), chain_name=paths.root.name, root=paths.root.parent,
                           frozen_blend=frozen)
    prepared = dataclasses.replace(prepared, loaded=loaded)
    import hashlib

    changes = [{"key": k, "old": _lookup(old_plain, k), "new": _lookup(new_plain, k)} for k in keys]
    return SettingsChange(
        prepared=prepared, changes=changes,
        blend_sha256={"old": blend_hash(paths), "new": prepared.blend_sha256},
        recipe_sha256={"old": manifest.get("recipe_sha256"),
                       "new": hashlib.sha256(prepared.files["run.yaml"].encode()).hexdigest()},
        data_changed=data_changed)


def _check_expert_layout(paths: RunPaths, old_plain: dict[str, Any], recipe: Recipe) -> None:
    """Megatron 0.19 cannot load an MoE checkpoint into another expert layout: EP or expert TP decide which
    parameters form the expert-parallel optimizer group (and, with the distributed optimizer, its buffers),
    and the load fails in the job ("Could not find parameter group", a missing `chained_N` key;
    tests/megatron/test_moe_resume.py). Refused here, before anything is written."""
    from megalaunch.config.model.moe import is_moe

    old_model, old_par = old_plain.get("model", {}), old_plain.get("parallel", {})
    if not (is_moe(recipe.model) and old_model.get("num_experts") and checkpoint_iterations(paths)):
        return
    p = recipe.parallel
    old_ep, new_ep = old_par.get("expert_model_parallel_size", 1), p.expert_model_parallel_size
    old_etp = old_par.get("expert_tensor_parallel_size") or old_par.get("tensor_model_parallel_size", 1)
    new_etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if (old_ep, old_etp) != (new_ep, new_etp):
        field = "expert_model_parallel_size" if old_ep != new_ep else "expert_tensor_parallel_size"
        raise ConfigError(f"cannot change on resume from EP {old_ep} x expert TP {old_etp} to EP {new_ep} x expert "
                          f"TP {new_etp}: Megatron cannot load the run's MoE checkpoints into another expert layout",
                          field=f"parallel.{field}",
                          fix=f"keep parallel.expert_model_parallel_size={old_ep} (and expert TP {old_etp}), or "
                              "convert the checkpoint (megalaunch convert) and submit a new run from it")


def _without_spent_load(paths: RunPaths, loaded: LoadedRecipe) -> LoadedRecipe:
    """`checkpoint.load` serves the first segment only: once the run has checkpoints of its own, a
    moved or deleted source checkpoint must not block a resume."""
    r = loaded.recipe
    if r.checkpoint.load and checkpoint_iterations(paths):
        r = dataclasses.replace(r, checkpoint=dataclasses.replace(r.checkpoint, load=None))
        return dataclasses.replace(loaded, recipe=r)
    return loaded


def check_resumable(paths: RunPaths, recipe: Recipe, *, from_iteration: int | None,
                    change: SettingsChange | None) -> None:
    """Refuse, in one line and before any job is queued, a resume that could only burn a job."""
    if change is None:  # the same preflight as submit, on the run's own frozen blend
        loaded = LoadedRecipe(recipe=recipe, raw={}, provenance={}, source="")
        prepare_run(_without_spent_load(paths, loaded), chain_name=paths.root.name, root=paths.root.parent,
                    frozen_blend=_frozen_blend(paths))
    tracker = paths.read_tracker()
    blend_record = (read_json(paths.manifest) or {}).get("data_blend_sha256")
    current = blend_hash(paths)
    if (change is None or not change.data_changed) and blend_record and current and current != blend_record:
        raise RunDirError(f"RUN/data_blend.txt was changed outside megalaunch (sha256 {current[:12]}; the "
                          f"manifest records {blend_record[:12]})",
                          fix=f"restore it, or change the blend with megalaunch resume {paths.root} "
                              "--set data.blend_file=FILE (or data.blend=[...]), which records the change")
    refused = unapproved_blend_change(paths, allow_change=recipe.checkpoint.allow_blend_change)
    if change is None and refused is not None:
        raise RunDirError(blend_change_refusal(paths, *refused))
    target = recipe.training.train_iters
    if from_iteration is None and tracker is not None and tracker >= target:
        raise RunDirError(f"the run already reached its target: checkpoint iteration {tracker} of "
                          f"training.train_iters {target}; a resume would stop at once",
                          fix=f"train further: megalaunch resume {paths.root} --set training.train_iters=N "
                              f"(N > {tracker}), or restart from an older checkpoint with --from ITER")
    if tracker is not None and not checkpoint_iterations(paths):
        raise RunDirError(f"the chain needs the checkpoint of iteration {tracker} (the tracker names it) but "
                          f"{paths.checkpoints} holds no iter_* directory",
                          fix="restore the checkpoints, or start a new run: megalaunch submit RECIPE")
    _check_format(paths, recipe, from_iteration if from_iteration is not None else tracker)
    load = recipe.checkpoint.load
    if tracker is None and not checkpoint_iterations(paths) and load and not os.path.isdir(load):
        raise RunDirError(f"the first segment loads {load}, which is not a directory", field="checkpoint.load",
                          fix=f"restore it, or megalaunch resume {paths.root} --set checkpoint.load=DIR")


def _check_format(paths: RunPaths, recipe: Recipe, iteration: int | None) -> None:
    """Megatron loads a checkpoint only in the format it saves: fsdp_dtensor (parallel.data_sharding: Megatron-FSDP)
    or torch_dist; a resume that switches between them would fail in the job."""
    from megalaunch.config.megatron_args import checkpoint_format
    from megalaunch.runtime.checkpoint.completeness import is_fsdp_dtensor
    from megalaunch.runtime.checkpoint.resume import iter_dir

    if iteration is None or not iter_dir(paths, iteration).is_dir():
        return
    saved = "fsdp_dtensor" if is_fsdp_dtensor(iter_dir(paths, iteration)) else "torch_dist"
    wants = checkpoint_format(recipe)
    if wants in ("torch_dist", "fsdp_dtensor") and saved != wants:
        raise RunDirError(f"checkpoint iteration {iteration} is {saved} and this run now saves and loads {wants} "
                          f"(parallel.data_sharding {recipe.parallel.data_sharding}): Megatron cannot load one as the other",
                          field="parallel.data_sharding",
                          fix="keep the data_sharding the checkpoints were saved with, or convert the checkpoint to "
                              "Hugging Face (megalaunch convert) and start a new run from it (submit --from-hf)")


def apply_change(paths: RunPaths, change: SettingsChange) -> None:
    """Replace the run's rendered files (each atomically, keeping its mode, never writable by others),
    then record the change and the new files' hashes, which the job checks (rundir/trust.py)."""
    from megalaunch.rundir.trust import file_hashes, recorded_hashes

    for rel, content in change.prepared.files.items():
        target = paths.root / rel
        mode = os.stat(target).st_mode & 0o7755 if target.exists() else 0o640
        atomic_write_text(target, content, mode=mode)
    record = {"changes": change.changes, "blend_sha256": change.blend_sha256,
              "recipe_sha256": change.recipe_sha256}
    event = Ledger(paths).append("settings_changed", by="megalaunch resume --set", **record)
    manifest = read_json(paths.manifest) or {}
    manifest["recipe_sha256"] = change.recipe_sha256["new"]
    manifest["data_blend_sha256"] = change.blend_sha256["new"]
    manifest["trusted_sha256"] = {**(recorded_hashes(paths) or {}), **file_hashes(change.prepared.files)}
    manifest["changes"] = [*manifest.get("changes", []),
                           {**record, "user": event["user"], "host": event["host"], "time": event["time"]}]
    atomic_write_json(paths.manifest, manifest, mode=os.stat(paths.manifest).st_mode & 0o7777)


def describe_change(change: SettingsChange) -> list[str]:
    lines = [f"  {c['key']}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}" for c in change.changes]
    old, new = change.blend_sha256["old"], change.blend_sha256["new"]
    if old != new:
        lines.append(f"  data blend sha256: {(old or 'none')[:12]} -> {(new or 'none')[:12]}")
    return lines
