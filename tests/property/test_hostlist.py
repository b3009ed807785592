"""Slurm host lists: `compress_hostlist` is the inverse of `expand_hostlist` for any names, in any order,
and compresses a block of numbered nodes into one range (rundir/hostlist.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from megalaunch.rundir.hostlist import compress_hostlist, expand_hostlist, node_names

prefixes = st.sampled_from(["node", "snode", "gpu-a", "n", "rack1-n", "login"])
name = st.one_of(
    st.builds(lambda p, n: f"{p}{n}", prefixes, st.integers(0, 2000)),
    st.builds(lambda p, n, w: f"{p}{n:0{w}d}", prefixes, st.integers(0, 999), st.integers(2, 4)),
    st.sampled_from(["vm", "login", "head-node"]),
)


@given(st.lists(name, unique=True, max_size=60))
def test_expanding_the_compressed_list_gives_the_names_back_in_order(names: list[str]) -> None:
    text = compress_hostlist(names)
    assert expand_hostlist(text) == names
    assert node_names(text) == names == node_names(names)


@given(st.integers(1, 1000), st.integers(1, 1000))
def test_a_block_of_nodes_is_one_range(first: int, count: int) -> None:
    names = [f"snode{i}" for i in range(first, first + count)]
    expected = f"snode{first}" if count == 1 else f"snode[{first}-{first + count - 1}]"
    assert compress_hostlist(names) == expected
