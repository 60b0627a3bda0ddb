"""GraySort records: 100 bytes, a 10-byte key and a 90-byte payload, generated, checksummed, partitioned
and sorted with vectorised numpy over fixed-width rows (no per-record Python except the CRC32 call).

Generator: the algorithm of Chris Nyberg's `gensort` 1.5 ("binary" records, the default of the sort
benchmark), as published in its source:

- a 128-bit linear congruential generator X' = (a·X + c) mod 2^128 with a = 0x2360ED051FC65DA44385DF649FCCF645
  and c = 0x4A696D47726179524950202020202001 ("JimGrayRIP" in ASCII); the random number of record r is
  R(r) = f^(r+1)(0), reached for any r by jumping (f^n is again affine, so it composes by squaring);
- record r is ten 10-byte parts: part j is the top 10 bytes of R(r+j) XOR a constant of part j (part 0,
  the key, has none);
- skewed keys (`gensort -s`): the top `b` bits of the key (b = bits 32..37 of R(r)'s low word, 0 when above
  48) are replaced by those of a table entry chosen by the bit length of r; entry i of that table is the top
  6 bytes of R(i) (checked against the published table in tests).

The checksum is valsort's: the sum over all records of zlib's CRC32 of the 100 bytes, as a 128-bit number.
"""

from __future__ import annotations

import zlib
from typing import Optional, Tuple

import numpy as np

RECORD = 100
KEY = 10
M128 = (1 << 128) - 1
LCG_A = 0x2360ED051FC65DA44385DF649FCCF645
LCG_C = 0x4A696D47726179524950202020202001

# (hi 64 bits, top 16 bits of the low word) XORed into the 10-byte parts 1..9 of a gensort 1.5 record
_PART_XOR = [(0, 0),
             (0xF0E8E4E2E1D8D4D2, 0xD1CC), (0xCAC9C6C5C3B8B4B2, 0xB1AC), (0xAAA9A6A5A39C9A99, 0x9695),
             (0x938E8D8B87787472, 0x716C), (0x6A696665635C5A59, 0x5655), (0x534E4D4B473C3A39, 0x3635),
             (0x332E2D2B271E1D1B, 0x170F), (0xC8C4C2C198949291, 0x8CE0), (0x170F332E2D2B271E, 0x1D1B)]

REC_DTYPE = np.dtype([("k8", ">u8"), ("k2", ">u2"), ("payload", "V90")])  # a view of raw records


# ---------------------------------------------------------------------------------------------------------------
# the 128-bit LCG

def jump(n: int) -> Tuple[int, int]:
    """(A, C) with f^n(x) = A·x + C mod 2^128."""
    A, C = 1, 0
    a, c = LCG_A, LCG_C
    while n:
        if n & 1:
            A, C = (a * A) & M128, (a * C + c) & M128
        a, c = (a * a) & M128, (a * c + c) & M128
        n >>= 1
    return A, C


def rand_at(r: int) -> int:
    """R(r) = f^(r+1)(0): the random number of record r."""
    return jump(r + 1)[1]


def _limbs(x: int) -> Tuple[int, int, int, int]:
    return x & 0xFFFFFFFF, (x >> 32) & 0xFFFFFFFF, (x >> 64) & 0xFFFFFFFF, (x >> 96) & 0xFFFFFFFF


def _affine(x: Tuple[np.ndarray, ...], A: int, C: int) -> Tuple[np.ndarray, ...]:
    """A·x + C mod 2^128 for arrays of 128-bit numbers held as four uint64 arrays of 32-bit limbs."""
    M = np.uint64(0xFFFFFFFF)
    S = np.uint64(32)
    a = [np.uint64(v) for v in _limbs(A)]
    c = [np.uint64(v) for v in _limbs(C)]
    x0, x1, x2, x3 = x
    p00 = x0 * a[0]
    p01, p10 = x0 * a[1], x1 * a[0]
    p02, p11, p20 = x0 * a[2], x1 * a[1], x2 * a[0]
    r0 = (p00 & M) + c[0]
    r1 = (p00 >> S) + (p01 & M) + (p10 & M) + c[1] + (r0 >> S)
    r2 = (p01 >> S) + (p10 >> S) + (p02 & M) + (p11 & M) + (p20 & M) + c[2] + (r1 >> S)
    r3 = ((p02 >> S) + (p11 >> S) + (p20 >> S) + x0 * a[3] + x1 * a[2] + x2 * a[1] + x3 * a[0] + c[3]
          + (r2 >> S))
    return r0 & M, r1 & M, r2 & M, r3 & M


def rand_block(first: int, n: int, lanes: int = 16384) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """R(first) .. R(first+n-1) as (top 64 bits, next 16 bits, bits 32..63 of the low word)."""
    hi = np.empty(n, np.uint64)
    top16 = np.empty(n, np.uint16)
    low_hi32 = np.empty(n, np.uint32)
    lanes = max(1, min(lanes, n))
    # the first `lanes` numbers by stepping in Python, then every block of lanes is one vectorised jump
    x = rand_at(first)
    start = []
    for _ in range(lanes):
        start.append(x)
        x = (LCG_A * x + LCG_C) & M128
    cur = tuple(np.array([(v >> (32 * k)) & 0xFFFFFFFF for v in start], np.uint64) for k in range(4))
    A, C = jump(lanes)
    for pos in range(0, n, lanes):
        m = min(lanes, n - pos)
        x0, x1, x2, x3 = (v[:m] for v in cur)
        hi[pos:pos + m] = (x3 << np.uint64(32)) | x2
        top16[pos:pos + m] = (x1 >> np.uint64(16)).astype(np.uint16)
        low_hi32[pos:pos + m] = x1.astype(np.uint32)
        if pos + lanes < n:
            cur = _affine(cur, A, C)
    return hi, top16, low_hi32


_SKEW_TABLE: Optional[np.ndarray] = None


def skew_table() -> np.ndarray:
    """The 129 skew prefixes of gensort -s, as the top 48 bits (uint64): entry i is the top 6 bytes of R(i)."""
    global _SKEW_TABLE
    if _SKEW_TABLE is None:
        _SKEW_TABLE = np.array([rand_at(i) >> 80 for i in range(129)], np.uint64)
    return _SKEW_TABLE


def gensort(first: int, n: int, skew: bool = False) -> np.ndarray:
    """Records first .. first+n-1 of gensort 1.5's binary output (`gensort -b<first> [-s] <n>`), as an
    (n, 100) uint8 array."""
    out = np.empty((n, RECORD), np.uint8)
    if n == 0:
        return out
    hi, top16, low_hi32 = rand_block(first, n + 9)
    for j, (xh, xl) in enumerate(_PART_XOR):
        h = hi[j:j + n] ^ np.uint64(xh) if xh else hi[j:j + n]
        t = top16[j:j + n] ^ np.uint16(xl) if xl else top16[j:j + n]
        out[:, 10 * j:10 * j + 8] = h.astype(">u8").view(np.uint8).reshape(n, 8)
        out[:, 10 * j + 8:10 * j + 10] = t.astype(">u2").view(np.uint8).reshape(n, 2)
    if skew:
        _apply_skew(out, first, n, low_hi32[:n])
    return out


def _apply_skew(out: np.ndarray, first: int, n: int, low_hi32: np.ndarray) -> None:
    r = np.arange(first, first + n, dtype=np.uint64)
    if first + n >= 1 << 53:
        raise ValueError("skewed generation supports record numbers below 2^53")
    _, index = np.frexp(r.astype(np.float64))      # the bit length of r (0 for r = 0): exact below 2^53
    bits = (low_hi32 & np.uint32(0x3F)).astype(np.int64)
    bits[bits > 48] = 0                            # a quarter of the records keep their random key
    key48 = np.zeros(n, np.uint64)
    for b in range(6):
        key48 = (key48 << np.uint64(8)) | out[:, b].astype(np.uint64)
    full = np.uint64((1 << 48) - 1)
    mask = np.where(bits > 0, (full << (48 - bits).astype(np.uint64)) & full, np.uint64(0))
    key48 = (skew_table()[index] & mask) | (key48 & ~mask & full)
    for b in range(6):
        out[:, b] = ((key48 >> np.uint64(8 * (5 - b))) & np.uint64(0xFF)).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# checksum, keys, partitioning, sorting

def as_records(buf) -> np.ndarray:
    """A flat byte buffer (bytes, bytearray, memoryview, uint8 array) as an (n, 100) uint8 array (a view)."""
    a = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if a.size % RECORD:
        raise ValueError(f"{a.size} bytes is not a whole number of {RECORD}-byte records")
    return a.reshape(-1, RECORD)


def checksum(recs: np.ndarray) -> int:
    """valsort's checksum: the sum of the CRC32 of every record (128-bit, as a Python int)."""
    if len(recs) == 0:
        return 0
    rows = np.ascontiguousarray(recs).view(np.dtype("V100")).reshape(-1)
    crcs = np.fromiter(map(zlib.crc32, rows.tolist()), np.uint64, count=len(rows))
    return int(crcs.sum(dtype=np.uint64)) if len(rows) < (1 << 32) else sum(map(int, crcs))


def keys(recs: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(first 8 key bytes as native uint64, last 2 as uint16): comparing (k8, k2) is comparing keys."""
    v = recs.reshape(-1).view(REC_DTYPE)
    return v["k8"].astype(np.uint64), v["k2"].astype(np.uint16)


def prefix_splits(bits: int) -> np.ndarray:
    """Split points (on the 8-byte key prefix) of 2^bits partitions by the top key bits."""
    return (np.arange(1, 1 << bits, dtype=np.uint64) << np.uint64(64 - bits)) if bits else np.zeros(0, np.uint64)


def partition(recs: np.ndarray, splits: Optional[np.ndarray], bits: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Records grouped by key range and the record count of each range. With `splits` (sorted 8-byte key
    prefixes) partition i holds splits[i-1] <= prefix < splits[i] (len(splits)+1 partitions); without, the
    top `bits` key bits name the partition (2^bits partitions, as in 3FS's GraySort)."""
    k8 = recs.reshape(-1).view(REC_DTYPE)["k8"].astype(np.uint64)
    if splits is None:
        nparts = 1 << bits
        bucket = (k8 >> np.uint64(64 - bits)) if bits else np.zeros(len(k8), np.uint64)
    else:
        nparts = len(splits) + 1
        bucket = np.searchsorted(splits, k8, side="right")
    del k8
    counts = np.bincount(bucket, minlength=nparts)
    if nparts <= 1 << 16:
        order = np.argsort(bucket.astype(np.uint16), kind="stable")  # a radix sort for 16-bit keys
    else:
        order = np.argsort(bucket, kind="stable")
    return take(recs, order), counts


def take(recs: np.ndarray, order: np.ndarray) -> np.ndarray:
    rows = recs.reshape(-1).view(np.dtype("V100"))
    return np.take(rows, order).view(np.uint8).reshape(-1, RECORD)


def sort_order(recs: np.ndarray) -> np.ndarray:
    """The permutation that sorts the records by their 10-byte key."""
    k8, k2 = keys(recs)
    order = np.argsort(k8)
    s = k8[order]
    if len(s) > 1 and bool((s[1:] == s[:-1]).any()):
        order = np.lexsort((k2, k8))  # equal 8-byte prefixes (skewed keys): order by all 10 bytes
    return order


def sort_records(recs: np.ndarray) -> np.ndarray:
    return take(recs, sort_order(recs))


def check_order(recs: np.ndarray) -> Tuple[int, int]:
    """(index of the first record whose key is smaller than its predecessor's or -1, number of records whose
    key equals its predecessor's)."""
    if len(recs) < 2:
        return -1, 0
    k8, k2 = keys(recs)
    a8, b8, a2, b2 = k8[:-1], k8[1:], k2[:-1], k2[1:]
    bad = (b8 < a8) | ((b8 == a8) & (b2 < a2))
    idx = np.flatnonzero(bad)
    dups = int(np.count_nonzero((b8 == a8) & (b2 == a2)))
    return (int(idx[0]) + 1 if len(idx) else -1), dups


def key_bytes(recs: np.ndarray, i: int) -> bytes:
    return bytes(recs[i, :KEY])
