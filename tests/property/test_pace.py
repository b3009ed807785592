"""Property: `tokens_per_s` of a running chain, which finds the newest segment on a tail of
state/metrics.jsonl and pairs only that segment's lines, gives what the whole-file definition gives, whatever the lines hold: jobs interleaved (an in-job
restart, a late line of an earlier segment), lines without a sample count or rate, samples going back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megalaunch.launcher.accounting.pace import tokens_per_s


def _whole_file(metrics: list[dict[str, Any]], running: bool) -> float | None:
    """The definition: every interval in file order; while running, the newest interval's job's last 20."""
    previous: dict[Any, int] = {}
    intervals: list[tuple[Any, int, float]] = []
    for r in metrics:
        job, samples, rate = r.get("job_id"), r.get("consumed_samples"), r.get("tokens_per_s")
        before = previous.get(job)
        if isinstance(samples, int):
            previous[job] = samples
        if (isinstance(before, int) and isinstance(samples, int) and samples > before
                and isinstance(rate, (int, float)) and rate > 0):
            intervals.append((job, samples - before, float(rate)))
    if running and intervals:
        intervals = [i for i in intervals if i[0] == intervals[-1][0]][-20:]
    if not intervals:
        return None
    return sum(n for _, n, _ in intervals) / sum(n / rate for _, n, rate in intervals)


_line = st.fixed_dictionaries(
    {"job_id": st.sampled_from(["1", "2", "3", 4, None])},
    optional={"consumed_samples": st.one_of(st.integers(0, 400), st.none(), st.just("8")),
              "tokens_per_s": st.one_of(st.floats(-1.0, 1e4, allow_nan=False), st.none(), st.just(0))})


@st.composite
def _metrics(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Mostly a chain's shape (segments one after another, samples growing), with noise mixed in."""
    lines: list[dict[str, Any]] = []
    samples = 0
    for job in range(draw(st.integers(0, 4))):
        for _ in range(draw(st.integers(0, 60))):
            samples += draw(st.integers(0, 16))
            lines.append({"job_id": str(job), "consumed_samples": samples,
                          "tokens_per_s": draw(st.floats(1.0, 1e4, allow_nan=False))})
    noise = draw(st.lists(st.tuples(st.integers(0, max(len(lines), 1)), _line), max_size=12))
    for at, line in sorted(noise, key=lambda x: -x[0]):
        lines.insert(at, line)
    return lines


@settings(max_examples=300, deadline=None)
@given(metrics=_metrics(), running=st.booleans())
def test_tail_read_equals_the_whole_file_definition(metrics: list[dict[str, Any]], running: bool) -> None:
    want = _whole_file(metrics, running)
    got = tokens_per_s(metrics, running=running)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(want, rel=1e-12)


def test_a_long_running_chain_shows_its_newest_segment() -> None:
    """5,000 segments x 4 lines and a late line of an old segment: the newest segment's own figure."""
    metrics = [{"job_id": str(job), "consumed_samples": 100 * job + 10 * k, "tokens_per_s": 1000.0 + job}
               for job in range(5000) for k in range(4)]
    metrics.append({"job_id": "17", "consumed_samples": None, "tokens_per_s": 5.0})
    assert tokens_per_s(metrics, running=True) == pytest.approx(1000.0 + 4999)
    assert tokens_per_s(metrics, running=False) == pytest.approx(_whole_file(metrics, False))
