"""Load a recipe: resolve includes, merge, apply `--set` overrides, build the typed schema (a training
`Recipe`, or a stage's own schema such as tokenization's, through the same code). Finding a recipe
file and reading one is config/recipe_files.py's.

Precedence, written down once: `--set` > the recipe file > its includes (later includes override
earlier ones) > schema defaults. Every leaf remembers which file or flag set it (provenance)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megalaunch.config.paths import expand_paths
from megalaunch.config.planner.auto import LayoutChoice, unpin, with_layout
from megalaunch.config.recipe_files import base_dir, display_name, find_recipe, load_yaml, read_recipe_file
from megalaunch.config.schema import Recipe
from megalaunch.config.typed import UnknownKeyError, build, field_types, to_plain
from megalaunch.errors import ConfigError, RunDirError
from megalaunch.rundir.paths import RunPaths

_MAX_INCLUDE_DEPTH = 16
# A schema's own treatment of one file's values before merging, given the directory its relative
# paths are relative to (tokenization anchors input and tokenizer paths there).
Anchor = Callable[[dict[str, Any], Path], None]
# Values from somewhere other than a recipe file or --set, each with its source (what run.yaml names).
Layers = Sequence[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    raw: dict[str, Any]  # merged mapping before typing (what the user wrote, composed)
    provenance: dict[str, str]  # dotted leaf path -> "file" or "--set"
    source: str  # what the user named
    layout: LayoutChoice | None = None  # how the layout was chosen (`parallel: auto`, config/planner/auto.py)

    def resolved(self) -> dict[str, Any]:
        """The complete recipe with defaults filled in, as plain data (written to run.yaml)."""
        return to_plain(self.recipe)

    def origin(self, dotted: str) -> str:
        return self.provenance.get(dotted, "default")


def _merge(dst: dict[str, Any], src: dict[str, Any], source: str, prov: dict[str, str], prefix: str = "",
           src_prov: dict[str, str] | None = None, src_prefix: str = "") -> None:
    """Deep-merge `src` into `dst`; leaves take their origin from `src_prov` (an included tree's own
    provenance) or else `source`."""
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        sdotted = f"{src_prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, source, prov, dotted + ".", src_prov, sdotted + ".")
        else:
            # a replaced subtree forgets where its old leaves came from
            for k in [k for k in prov if k.startswith(dotted + ".")]:
                del prov[k]
            dst[key] = copy.deepcopy(value)
            _mark(value, source, prov, dotted, src_prov, sdotted)


def _mark(value: Any, source: str, prov: dict[str, str], dotted: str,
          src_prov: dict[str, str] | None = None, sdotted: str = "") -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _mark(v, source, prov, f"{dotted}.{k}", src_prov, f"{sdotted}.{k}")
    else:
        prov[dotted] = (src_prov or {}).get(sdotted, source)


def _section_type(tp: Any) -> Any:
    """The dataclass a field holds (Optional stripped), or list[dataclass] as ("list", cls), or None."""
    import types
    import typing

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else tp
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return ("list", typing.get_args(tp)[0])
    return None


def _check_shapes(data: Any, schema: Any, where: str, prefix: str = "") -> None:
    """Each file on its own: a section must be a mapping (a list of mappings where the schema says so),
    even when a later file or a --cluster profile would replace it."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(schema):
        return
    hints = field_types(schema)
    for key, value in data.items():
        if key not in hints or value is None:
            continue
        kind = _section_type(hints[key])
        field = f"{prefix}{key}"
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{type(value).__name__} {value!r} in {where} where a mapping belongs",
                                  field=field, valid="a mapping (key: value lines under it)",
                                  fix=f"write {field} as a mapping, or remove it")
            _check_shapes(value, kind, where, field + ".")
        elif isinstance(kind, tuple) and (not isinstance(value, list) or not all(isinstance(v, dict) for v in value)):
            raise ConfigError(f"{value!r} in {where} is not a list of mappings", field=field,
                                  valid="a list of mappings", fix=f"write {field} as a list of mappings")


def _load_tree(path: Path, prov: dict[str, str], stack: tuple[Path, ...], anchor: Anchor | None = None,
               group: str = "train", schema: Any = None) -> dict[str, Any]:
    """The composed tree of `path`; fills `prov` with the origin of each of its leaves."""
    if path in stack:
        chain = " -> ".join(display_name(p) for p in (*stack, path))
        raise ConfigError(f"include cycle: {chain}", field="include", fix="remove one of the includes")
    if len(stack) > _MAX_INCLUDE_DEPTH:
        raise ConfigError("includes nest too deeply", field="include")
    data = read_recipe_file(path)
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"expected a list of recipe names, got {includes!r}", field=f"{display_name(path)}: include")
    auto = data.get("parallel") == "auto"  # `parallel: auto`: every layout field given before it is unpinned
    if auto:
        data["parallel"] = {"layout": "auto"}
    if schema is not None:
        _check_shapes(data, schema, display_name(path))
    if anchor is not None:
        anchor(data, base_dir(path))
    merged: dict[str, Any] = {}
    for inc in includes:
        inc_path = find_recipe(inc, path.parent, group)
        sub_prov: dict[str, str] = {}
        sub = _load_tree(inc_path, sub_prov, (*stack, path), anchor, group, schema)
        _merge(merged, sub, display_name(inc_path), prov, src_prov=sub_prov)
    if auto:
        unpin(merged, prov)
    _merge(merged, data, display_name(path), prov)
    return merged


def parse_set(expr: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a','b'], value). Values are YAML: numbers, true/false, null, [lists], {maps}."""
    if "=" not in expr:
        raise ConfigError(f"--set {expr!r} is not KEY=VALUE", fix="e.g. --set training.lr=3e-4")
    key, text = expr.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {expr!r}: empty key", fix="e.g. --set training.lr=3e-4")
    try:
        value = load_yaml(text, f"--set {key}") if text.strip() else ""
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(f"--set {key}: {e.problem}") from None
    except (yaml.YAMLError, ValueError):  # ValueError: a date or number Python cannot build
        value = text  # not YAML: take it as a plain string
    return key.split("."), value


def _check_path(parts: list[str], schema: Any = Recipe) -> None:
    """Reject `--set` keys that name no schema field, with a did-you-mean at the failing level."""
    cls: Any = schema
    for i, part in enumerate(parts):
        if cls is None or not dataclasses.is_dataclass(cls):
            return  # inside a free-form mapping (env, megatron_args, ...)
        hints = field_types(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            dotted = ".".join(parts[: i + 1])
            raise UnknownKeyError(part, f"--set {dotted}", names, root=schema)
        tp = hints[part]
        cls = tp if dataclasses.is_dataclass(tp) else None


def apply_sets(tree: dict[str, Any], sets: list[str], prov: dict[str, str], schema: Any = Recipe,
               anchor: Anchor | None = None) -> None:
    for expr in sets:
        parts, value = parse_set(expr)
        if parts == ["parallel"] and value == "auto":  # the planner chooses every layout field (planner/auto.py)
            unpin(tree, prov)
            parts = ["parallel", "layout"]
        _check_path(parts, schema)
        if anchor is not None:  # paths on the command line are relative to the cwd
            wrapped: dict[str, Any] = {parts[-1]: value}
            for part in reversed(parts[:-1]):
                wrapped = {part: wrapped}
            anchor(wrapped, Path.cwd())
            for part in parts:
                wrapped = wrapped[part]
            value = wrapped
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        _merge(node, {parts[-1]: value}, "--set", prov, ".".join(parts[:-1]) + "." if len(parts) > 1 else "")


def load_tree(ref: str, sets: list[str] | tuple[str, ...] = (), *, schema: Any = Recipe, group: str = "train",
              anchor: Anchor | None = None, cluster: str | None = None, name: str | None = None,
              layers: Layers = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """The composed, overridden mapping of a recipe of `schema` and where each leaf came from. `layers`:
    (source, values) merged over the recipe and cluster, under `--set` (`submit --from-hf`'s model shape)."""
    path = find_recipe(ref, group=group)
    prov: dict[str, str] = {}
    tree = _load_tree(path, prov, (), anchor, group, schema)
    if cluster is not None:
        ref_c = cluster if "/" in cluster or cluster.endswith(".yaml") else f"clusters/{cluster}"
        cpath = find_recipe(ref_c)
        sub_prov: dict[str, str] = {}
        _merge(tree, _load_tree(cpath, sub_prov, (), schema=schema), display_name(cpath), prov, src_prov=sub_prov)
    for source, values in layers:
        _merge(tree, values, source, prov)
    apply_sets(tree, list(sets), prov, schema, anchor)
    if name is not None:
        _merge(tree, {"name": name}, "--name", prov)
    return tree, prov


def load_recipe(ref: str, sets: list[str] | tuple[str, ...] = (), *, name: str | None = None,
                cluster: str | None = None, layers: Layers = (), plan_layout: bool = True) -> LoadedRecipe:
    """Load, compose, override and type-check a training recipe. Raises ConfigError (one line) on any
    problem. `cluster` names a cluster profile merged on top of the recipe (before `--set`), then `layers`.
    `plan_layout`: resolve `parallel: auto` for the recipe's GPUs (config/planner/auto.py)."""
    tree, prov = load_tree(ref, sets, cluster=cluster, name=name, layers=layers)
    recipe = expand_paths(build(Recipe, tree))  # ~ and $VAR in path fields, once, here (config/paths.py)
    recipe, layout = with_layout(recipe, tree, prov) if plan_layout else (recipe, None)
    return LoadedRecipe(recipe=recipe, raw=tree, provenance=prov, source=ref, layout=layout)


def load_resolved(data: dict[str, Any]) -> Recipe:
    """Re-type a resolved recipe (run.yaml)."""
    return build(Recipe, data)


def read_run_tree(paths: RunPaths) -> dict[str, Any]:
    """A run's run.yaml as plain data (`megalaunch resume --set` overrides it)."""
    if not paths.run_yaml.is_file():
        raise RunDirError(f"{paths.root} is not a megalaunch run directory (no run.yaml)",
                          fix="pass the directory that `megalaunch submit` printed")
    return read_recipe_file(paths.run_yaml)


def load_run_recipe(paths: RunPaths) -> Recipe:
    """The typed recipe of a run directory (its run.yaml)."""
    if not paths.run_yaml.is_file():
        raise RunDirError(f"{paths.root} is not a megalaunch run directory (no run.yaml)",
                          fix="pass the directory that `megalaunch submit` printed")
    return load_resolved(read_recipe_file(paths.run_yaml))  # a damaged run.yaml is a ConfigError naming it
