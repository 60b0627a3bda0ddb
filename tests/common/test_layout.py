"""The layout shuffle is pinned: docs/architecture.md promises that a file's chunk -> chain mapping never
changes (files written by one version are read by every later one). These golden values were computed
once; a change to splitmix64, the Fisher-Yates walk or the position arithmetic fails here."""

from __future__ import annotations

import pytest

from threefs.common.layout import Layout, chain_of_chunk, chain_positions, split_range, splitmix64


def test_splitmix64_matches_the_reference_sequence():
    # splitmix64 seeded with 0: first output 0xe220a8397b1dcdaf (Vigna's reference implementation)
    state, out = splitmix64(0)
    assert out == 0xE220A8397B1DCDAF
    assert splitmix64(state)[1] == 0x6E789E6AA1B965F4


@pytest.mark.parametrize("base, stripe, seed, positions", [
    (1, 8, 0, (3, 6, 1, 4, 5, 7, 2, 8)),
    (5, 16, 42, (17, 18, 9, 7, 19, 11, 12, 13, 16, 20, 14, 15, 8, 5, 6, 10)),
    (3, 7, 0xDEADBEEF, (8, 4, 6, 3, 7, 9, 5)),
    (1, 1, 9, (1,)),
    (100, 4, 2**64 - 1, (102, 101, 103, 100)),
])
def test_chain_positions_are_pinned(base, stripe, seed, positions):
    assert chain_positions(base, stripe, seed) == positions


def test_chain_of_chunk_is_pinned():
    table = [101, 102, 103, 104, 105, 106]
    layout = Layout(1, 1, 1 << 20, 8, base_index=1, seed=0)
    assert [chain_of_chunk(layout, i, table) for i in range(10)] == [
        103, 106, 101, 104, 105, 101, 102, 102, 103, 106]


def test_split_range_covers_the_range_once():
    spans = list(split_range(1 << 20, (1 << 20) - 10, 30))
    assert [(s.chunk_index, s.chunk_offset, s.length, s.buffer_offset) for s in spans] == [
        (0, (1 << 20) - 10, 10, 0), (1, 0, 20, 10)]
