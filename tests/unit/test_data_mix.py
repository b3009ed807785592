"""Mixtures: links without repetition (token-level shares, stops at the limiting source) and
Megatron-style weighted blends; report table; immutability."""

from __future__ import annotations

import json
import os

import pytest

from megalaunch.data.blend import resolve_blend
from megalaunch.data.mix import format_report, plan_mixture, write_mixture
from megalaunch.data.writer import write_dataset
from megalaunch.errors import ConfigError, PreflightError


def _source(root, name, sizes):
    folder = root / name
    folder.mkdir()
    for i, n in enumerate(sizes):
        write_dataset(folder / f"p{i:03d}", [[1] * n])
    return folder


@pytest.fixture
def sources(tmp_path):
    big = _source(tmp_path, "web", [100] * 40)  # 4,000 tokens in 40 pairs
    small = _source(tmp_path, "code", [100] * 5)  # 500 tokens
    return big, small


def test_links_stop_when_the_limiting_source_is_exhausted(sources, tmp_path):
    web, code = sources
    mix = plan_mixture([str(web), str(code)], [0.8, 0.2])
    web_s, code_s = mix.sources
    assert len(code_s.chosen) == 5  # all of the limiting source
    assert len(web_s.chosen) == 20  # 2,000 tokens: 0.8 / 0.2 * 500
    assert len({p for p, _ in web_s.chosen}) == 20  # no repetition
    assert mix.share(web_s) == pytest.approx(0.8, abs=0.02)
    out = write_mixture(mix, tmp_path / "mix")
    links = sorted(p.name for p in (out / "web").iterdir())
    assert len(links) == 40 and all(os.path.islink(out / "web" / n) for n in links)
    blend = resolve_blend([(str(out), None)])
    assert sum(w for p, w in blend.prefixes if "/web/" in p) == 2000
    report = json.loads((out / "mixture.json").read_text())
    assert [r["tokens"] for r in report["sources"]] == [2000, 500]
    table = format_report(mix, train_tokens=5000)
    assert "web" in table and "2,000" in table and "2.00" in table  # 5000 tokens = 2 epochs of the mix


def test_shares_are_in_tokens_not_bytes(tmp_path):
    # same token counts, different dtypes (int32 files are twice as large): a 50/50 mix by tokens
    a = tmp_path / "a"
    a.mkdir()
    b = tmp_path / "b"
    b.mkdir()
    for i in range(10):
        write_dataset(a / f"p{i}", [[1] * 50], dtype="uint16")
        write_dataset(b / f"p{i}", [[1] * 50], dtype="int32")
    mix = plan_mixture([str(a), str(b)], [1, 1])
    assert [len(s.chosen) for s in mix.sources] == [10, 10]


def test_selection_is_deterministic_and_seeded(sources):
    web, code = sources
    first = plan_mixture([str(web), str(code)], [0.8, 0.2])
    again = plan_mixture([str(web), str(code)], [0.8, 0.2])
    other = plan_mixture([str(web), str(code)], [0.8, 0.2], seed=7)
    assert first == again
    assert first.sources[0].chosen != other.sources[0].chosen


def test_blend_mode_keeps_every_pair_and_the_weights(sources, tmp_path):
    web, code = sources
    mix = plan_mixture([str(web), str(code)], [0.8, 0.2], mode="blend")
    assert [len(s.chosen) for s in mix.sources] == [40, 5]
    out = write_mixture(mix, tmp_path / "blend")
    words = (out / "data_blend.txt").read_text().split()
    weights = {p: float(w) for w, p in zip(words[0::2], words[1::2], strict=True)}
    assert sum(w for p, w in weights.items() if "/code/" in p) == pytest.approx(0.2)
    assert len(weights) == 45


def test_errors_and_immutability(sources, tmp_path):
    web, code = sources
    with pytest.raises(ConfigError, match="2 folders but 1 weights"):
        plan_mixture([str(web), str(code)], [1.0])
    with pytest.raises(ConfigError, match="positive"):
        plan_mixture([str(web)], [0.0])
    with pytest.raises(PreflightError, match="not a directory"):
        plan_mixture([str(tmp_path / "nope")], [1.0])
    mix = plan_mixture([str(web), str(code)], [0.8, 0.2])
    write_mixture(mix, tmp_path / "m")
    write_mixture(mix, tmp_path / "m")  # the same mixture again: fine
    with pytest.raises(PreflightError, match="holds something else"):
        write_mixture(plan_mixture([str(web), str(code)], [0.5, 0.5]), tmp_path / "m")
