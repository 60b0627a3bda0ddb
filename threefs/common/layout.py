"""File layout: which chain holds which chunk, computed by the client so meta stays off the data path.

A layout is `{table_id, table_version, chunk_size, stripe, base_index, seed}`. The file's chain list is
the `stripe` consecutive chain-table positions starting at `base_index` (1-based, wrapping), shuffled by
a *pinned* Fisher-Yates driven by splitmix64(seed). 3FS used std::shuffle over MT19937, whose result
depends on the C++ standard library (3FS#368); ours is defined here, byte for byte, and never changes.

    chunk index i  ->  position list[i % stripe]  ->  chain table[(position - 1) % len(table)]
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator, NamedTuple

import msgspec

from threefs.common import limits
from threefs.common.status import StatusCode, status_error

_MASK64 = (1 << 64) - 1


class Layout(msgspec.Struct, frozen=True):
    table_id: int
    table_version: int
    chunk_size: int
    stripe: int
    base_index: int = 1
    seed: int = 0

    def validate(self) -> "Layout":
        cs = self.chunk_size
        if cs < limits.CHUNK_SIZE_BYTES_MIN or cs > limits.CHUNK_SIZE_BYTES_MAX or cs & (cs - 1):
            raise status_error(
                StatusCode.INVALID_ARGUMENT,
                f"chunk size {cs} must be a power of two in "
                f"[{limits.CHUNK_SIZE_BYTES_MIN}, {limits.CHUNK_SIZE_BYTES_MAX}]",
            )
        if not 1 <= self.stripe <= limits.STRIPE_MAX:
            raise status_error(
                StatusCode.INVALID_ARGUMENT, f"stripe {self.stripe} must be in [1, {limits.STRIPE_MAX}]"
            )
        return self


def splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64: returns (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


@lru_cache(maxsize=4096)
def chain_positions(base_index: int, stripe: int, seed: int) -> tuple[int, ...]:
    """The file's shuffled, 1-based chain-table positions (pinned algorithm, see module doc)."""
    positions = list(range(base_index, base_index + stripe))
    state = seed & _MASK64
    for i in range(stripe - 1, 0, -1):
        state, r = splitmix64(state)
        j = r % (i + 1)
        positions[i], positions[j] = positions[j], positions[i]
    return tuple(positions)


def chain_of_chunk(layout: Layout, chunk_index: int, table: list[int] | tuple[int, ...]) -> int:
    if not table:
        raise status_error(
            StatusCode.CHAIN_TABLE_NOT_FOUND, f"chain table {layout.table_id} is empty or unknown"
        )
    positions = chain_positions(layout.base_index, layout.stripe, layout.seed)
    position = positions[chunk_index % layout.stripe]
    return table[(position - 1) % len(table)]


class ChunkSpan(NamedTuple):
    chunk_index: int
    chunk_offset: int  # offset inside the chunk
    length: int
    buffer_offset: int  # offset inside the caller's buffer


def split_range(chunk_size: int, offset: int, length: int) -> Iterator[ChunkSpan]:
    """Cut a file range into per-chunk pieces."""
    if offset < 0 or length < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"negative offset/length {offset}/{length}")
    pos, end, done = offset, offset + length, 0
    while pos < end:
        index, inner = divmod(pos, chunk_size)
        n = min(chunk_size - inner, end - pos)
        yield ChunkSpan(index, inner, n, done)
        pos += n
        done += n
