"""Property: whatever string a recipe field holds, the run directory that submit writes gives the same
typed recipe back: `load_run_recipe(write_run(prepare_run(loaded)))` equals `loaded.recipe`, field by
field. (run.yaml holds the resolved recipe; reading it back must not change, expand or lose anything.)"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from tests.property.fields import StringField, hostile_text, merge, override, string_fields
from tests.property.recipes import write_recipe

from megalaunch.config.loader import load_recipe, load_run_recipe
from megalaunch.config.schema import Recipe
from megalaunch.config.typed import to_plain
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.self_cli import with_job_megalaunch
from megalaunch.launcher.prepare.write import write_run

# debug.code_snapshot names a directory write_run copies into the run directory: arbitrary text can
# name "/" or "..". What it does is covered by tests/unit/test_render.py; here it stays unset.
ROUND_TRIP_FIELDS = [f for f in string_fields(Recipe) if f.path != "debug.code_snapshot"]
PER_FIELD = max(settings().max_examples // 8, 4)


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path.lstrip('.')}: {a!r} -> {b!r}"]


@pytest.mark.parametrize("field", ROUND_TRIP_FIELDS, ids=str)
@settings(max_examples=PER_FIELD)
@given(text=hostile_text, profile=st.sampled_from(["local", "slurm", "pyxis", "cscs"]))
def test_run_yaml_round_trip(field: StringField, text: str, profile: str) -> None:
    with tempfile.TemporaryDirectory(prefix="mlprop-rt-") as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        mp.setenv("HOME", str(root))
        mp.chdir(root)
        tree = merge({"include": ["tiny", f"clusters/{profile}"], "name": "rt"}, override(field, text))
        try:
            loaded = load_recipe(str(write_recipe(root / "recipe.yaml", tree)))
            # the run root is fixed (run.root itself is still written to and read from run.yaml)
            paths = write_run(prepare_run(loaded, root=root / "runs"))
        except MegalaunchError:
            return
        note(paths.run_yaml.read_text())
        back = load_run_recipe(paths)
        # what the run records: the recipe with the job's megalaunch resolved (launcher/prepare/self_cli.py)
        expected = with_job_megalaunch(loaded).recipe
        assert _diff(to_plain(expected), to_plain(back)) == []
        assert back == expected
