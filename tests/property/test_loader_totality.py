"""Property: the loader is total. Arbitrary bytes, arbitrary YAML documents (random keys, real key
names with values of the wrong type, nested anywhere) and arbitrary `--set` text either load or fail
with one of megalaunch's own errors (and so do preflight and rendering of what loaded): never a
KeyError, TypeError, AttributeError, RecursionError, UnicodeDecodeError ... traceback."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.property.fields import FRAGMENTS, hostile_text

from megalaunch.config.loader import load_recipe, load_run_recipe
from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.rundir.paths import RunPaths
from megalaunch.tokenization.recipe import TokenizeRecipe, load_tokenize_recipe


def _names(cls: Any, prefix: str = "") -> Iterator[str]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _names(hints[f.name], f"{prefix}{f.name}.")


DOTTED = sorted({*_names(Recipe), "include"})
KEYS = sorted({d.rsplit(".", 1)[-1] for d in DOTTED} | {d.rsplit(".", 1)[-1] for d in _names(TokenizeRecipe)})

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**310),
                    st.floats(), st.text(max_size=12), st.sampled_from(FRAGMENTS), st.sampled_from(KEYS),
                    st.binary(max_size=8), st.dates())
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8), st.integers()),
                                            inner, max_size=5)),
    max_leaves=25)
# Documents that start from a real recipe, so the random part reaches deeper than the top level.
based = st.builds(lambda doc, inc: {"include": [inc], "name": "t", **doc} if isinstance(doc, dict) else doc,
                  documents, st.sampled_from(["tiny", "llama3-8b", "demo"]))
# YAML syntax itself: anchors, aliases, tags, flow and block markers, dates and numbers.
YAML_BITS = ["&a [*a]", "2024-13-45", "&a ", "*a", "!!binary ", "!!set ", "!!omap ", "!!python/object:os.system ", "!!str ", "!!int ",
             "!!float ", "? ", ": ", "- ", "[", "]", "{", "}", ",", "\n", "\n  ", "'", '"', "|", ">", "#", "%YAML 1.1\n",
             "---\n", "...\n", "2024-13-45", "1" * 5000, "0x", "0o9", ".nan", ".inf", "1e400", "include: ",
             "cluster:", "name: x", "  env:", "megatron_args: ", "<<: *a"]
# Whole values that YAML resolves to something Python cannot build, or builds recursively.
NASTY = ["2024-13-45", "2024-02-30 25:61:61", "1" * 5000, "-" + "9" * 4400, ".nan", ".inf", "-.inf", "1e400",
         "-1e400", "&a [*a]", "&a {x: *a}", "!!binary AAA", "!!set {a, b}", "!!omap [a: 1]", "0", "-1", "~",
         "[" * 2000, "{a: [{b: [" * 50, "!!timestamp x", "0o9", "0b2", "1_000", "0x_", ""]
yaml_text = st.lists(st.one_of(st.sampled_from(YAML_BITS), st.sampled_from(KEYS), st.text(max_size=6)),
                     max_size=14).map("".join)


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mlprop-load-") as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", tmp)
        mp.chdir(tmp)
        yield Path(tmp)


def _load_everything(path: Path, sets: list[str] = ()) -> None:  # type: ignore[assignment]
    try:
        loaded = load_recipe(str(path), list(sets))
        prepare_run(loaded, root=path.parent / "runs", created="T")
    except MegalaunchError:
        pass


def _dump(doc: Any) -> str:
    try:
        return yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:  # bytes, dates and the like are representable; anything else is not a test
        return yaml.safe_dump(repr(doc))


@given(raw=st.one_of(st.binary(max_size=200), yaml_text.map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_any_bytes_as_a_recipe_file(raw: bytes) -> None:
    with workdir() as tmp:
        (tmp / "r.yaml").write_bytes(raw)
        _load_everything(tmp / "r.yaml")


@given(doc=st.one_of(documents, based))
def test_any_yaml_document_as_a_recipe(doc: Any) -> None:
    with workdir() as tmp:
        (tmp / "r.yaml").write_text(_dump(doc))
        _load_everything(tmp / "r.yaml")


@settings(max_examples=settings().max_examples * 5)  # cheap: a load and a preflight per example
@given(text=st.one_of(st.sampled_from(NASTY), yaml_text, hostile_text), key=st.sampled_from(DOTTED))
def test_any_set_text(text: str, key: str) -> None:
    with workdir() as tmp:
        (tmp / "r.yaml").write_text("include: [tiny]\nname: s\n")
        _load_everything(tmp / "r.yaml", [text])  # the whole --set argument is arbitrary
        _load_everything(tmp / "r.yaml", [f"{key}={text}"])  # a real key, an arbitrary value


@given(doc=st.one_of(documents, based), raw=st.binary(max_size=64))
def test_any_run_yaml(doc: Any, raw: bytes) -> None:
    """A run directory's run.yaml edited or damaged by hand: a megalaunch error, not a traceback."""
    with workdir() as tmp:
        paths = RunPaths(tmp / "run")
        paths.root.mkdir()
        for content in (_dump(doc).encode(), raw):
            paths.run_yaml.write_bytes(content)
            with contextlib.suppress(MegalaunchError):
                load_run_recipe(paths)


@given(doc=st.one_of(documents, st.builds(lambda d: {"include": ["tokenize/jsonl"], **d} if isinstance(d, dict)
                                           else d, documents)), text=yaml_text)
def test_any_tokenize_recipe(doc: Any, text: str) -> None:
    with workdir() as tmp:
        (tmp / "t.yaml").write_text(_dump(doc))
        for sets in ([], [text]):
            with contextlib.suppress(MegalaunchError):
                load_tokenize_recipe(str(tmp / "t.yaml"), sets)


def test_fields_of_every_section_are_keys() -> None:
    assert {"cluster.env", "megatron_args", "include", "cluster.container.image"} <= set(DOTTED)
