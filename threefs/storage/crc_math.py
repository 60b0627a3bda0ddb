"""CRC32C algebra: shift a CRC over appended zeros and patch a CRC for a changed range, without the data.

CRC32C is affine over GF(2): for messages of equal length, crc(M1) ^ crc(M2) = crc0(M1 ^ M2), where crc0
is the bare CRC (register starting at 0, no final xor), and crc0(D followed by T zero bytes) is crc0(D)
times x^(8T) mod P. So replacing bytes [off, off+n) of a message of length L changes its CRC by
shift(crc0(old) ^ crc0(new), L - off - n): the new CRC costs O(n), not O(L) (3FS combines CRCs the
same way, with crc32c_combine). multmodp / x2nmodp follow zlib's crc32.c (reflected polynomial).
"""

from __future__ import annotations

from functools import lru_cache

from threefs.common import crc32c

POLY = 0x82F63B78  # CRC32C, reflected


def multmodp(a: int, b: int) -> int:
    """a * b mod P (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _table() -> list[int]:
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)
        p = multmodp(p, p)
    return out


_X2N = _table()


@lru_cache(maxsize=4096)
def x8n(n: int) -> int:
    """x^(8n) mod P."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def shift(crc0_value: int, zeros: int) -> int:
    """crc0 of (message followed by `zeros` zero bytes), given crc0 of the message."""
    return multmodp(x8n(zeros), crc0_value) if zeros else crc0_value


def crc0(data) -> int:
    """The bare CRC32C of data (register from 0, no final xor)."""
    return crc32c.crc32c(data, value=0xFFFFFFFF) ^ 0xFFFFFFFF


def patch(crc: int, length: int, offset: int, old, new) -> int:
    """CRC32C of a `length`-byte message whose CRC is `crc` after bytes [offset, offset+len(old)) change
    from `old` to `new` (same length)."""
    assert len(old) == len(new) and offset + len(old) <= length
    return crc ^ shift(crc0(old) ^ crc0(new), length - offset - len(old))
