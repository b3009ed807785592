"""run.yaml's scalars (launcher/prepare/explain.py): the short cut for common keys and values writes
exactly what PyYAML's emitter writes, and everything reads back as the value it came from."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megalaunch.launcher.prepare.explain import _scalar, _scalar_dumped

# YAML 1.1's other types written as plain text (PyYAML's resolver), and what surrounds them
TRICKY = ["yes", "No", "ON", "off", "y", "n", "true", "False", "null", "Null", "NULL", "~", "", "1", "0x1F", "0o17",
          "017", "1_000", "1.5", "1e3", "1.0e-05", ".inf", "-.inf", ".nan", ".NaN", "2024-01-01", "2024-01-01 10:00:00",
          "1:30", "190:20:30", "=", "<<", "-", "--", "---", "...", "a b", "a:b", "a: b", "#x", "a#b", "a #b", "[x]",
          "{x}", "a,b", "x\n", "é", "a\x85b", "_", "_1", "1abc", "a.b/c-d", "./x", "/abs/path", "llama3-8b",
          "train/tiny", "1.", "1.0.0", "+1", "-1", "0b101", "1__0", "6.8e+5", "abc.", "ON_", "Yes1", "nul"]


def _reads_back(value: object) -> None:
    text = _scalar(value)
    assert "\n" not in text
    back = yaml.safe_load(text)
    if isinstance(value, float) and math.isnan(value):
        assert isinstance(back, float) and math.isnan(back)
    else:
        assert back == value and type(back) is type(value)


@pytest.mark.parametrize("value", [*TRICKY, None, True, False, 0, -7, 10**30, 1.5, -0.0, 1e-5, float("inf"),
                                   float("nan")], ids=repr)
def test_common_scalars_are_written_as_pyyaml_writes_them(value: object) -> None:
    assert _scalar(value) == _scalar_dumped(value)
    _reads_back(value)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-+:# ~", max_size=12),
                 st.integers(), st.none(), st.booleans()))
def test_any_short_text_or_number_is_written_as_pyyaml_writes_it(value: object) -> None:
    assert _scalar(value) == _scalar_dumped(value)
    _reads_back(value)
