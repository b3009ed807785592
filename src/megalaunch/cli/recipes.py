"""`megalaunch recipes list|show|validate`."""

from __future__ import annotations

from typing import Annotated

import typer

from megalaunch.cli.options import ClusterOpt, SetOpt
from megalaunch.cli.output import say

app = typer.Typer(no_args_is_help=True)



def _is_tokenize(ref: str) -> bool:
    from megalaunch.config.recipe_files import find_recipe

    return find_recipe(ref).parent.name == "tokenize"


@app.command("list")
def list_() -> None:
    """Shipped recipes, by group."""
    from megalaunch.config.recipe_files import shipped_recipes

    group = None
    for key, path in shipped_recipes().items():
        g, name = key.split("/", 1)
        if g != group:
            say(f"{g}/")
            group = g
        first = next((ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        say(f"  {name:<22} {first}")


@app.command()
def show(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    set_: SetOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="Say which file or flag set each value.")] = False,
    cluster: ClusterOpt = None,
) -> None:
    """Print a recipe fully resolved (with defaults)."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.recipe_files import find_recipe

    if _is_tokenize(recipe):
        import yaml

        from megalaunch.tokenization.recipe import load_tokenize_recipe

        _, merged = load_tokenize_recipe(recipe, list(set_ or []))
        say(yaml.safe_dump(merged, sort_keys=False).rstrip())
        return
    if not explain and set_ is None and cluster is None and find_recipe(recipe).parent.name in ("models", "clusters", "training"):
        say(find_recipe(recipe).read_text().rstrip())  # a fragment: show it as written
        return
    from megalaunch.launcher.prepare.explain import yaml_with_origins

    loaded = load_recipe(recipe, list(set_ or []), cluster=cluster)
    resolved = loaded.resolved()

    def explained(dotted: str) -> str:
        """Where the value came from, and what was written when a path was expanded (~, $VAR)."""
        where = loaded.origin(dotted)
        written: object = loaded.raw
        for part in dotted.split("."):
            written = written.get(part) if isinstance(written, dict) else None
        value: object = resolved
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(written, (str, list)) and written != value and where != "default":
            return f"{where}; written {written!r}"
        return where

    say(yaml_with_origins(resolved, explained if explain else (lambda _: "default")).rstrip())


@app.command()
def validate(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name.")],
    set_: SetOpt = None,
    cluster: ClusterOpt = None,
) -> None:
    """Run every check `submit` runs (schema and preflight) without writing anything."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.preflight import preflight, signal_lead_s

    if _is_tokenize(recipe):
        from megalaunch.tokenization.recipe import load_tokenize_recipe

        tok, _ = load_tokenize_recipe(recipe, list(set_ or []))
        say(f"ok: tokenization recipe ({type(tok).__name__})")
        return

    loaded = load_recipe(recipe, list(set_ or []), cluster=cluster)
    topo, blend = preflight(loaded.recipe)
    say(f"ok: {loaded.recipe.name}: world {topo.world_size} = TP {topo.tp} x PP {topo.pp} x CP {topo.cp} x "
        f"DP {topo.dp}, {topo.num_microbatches} micro-batches per step, signal lead "
        f"{signal_lead_s(loaded.recipe)} s" + (f", data blend {blend.sha256[:12]}" if blend else ""))
