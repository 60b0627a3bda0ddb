"""threefs.common.crc32c: the implementation in use gives the same CRC32C as ICRAR's package on every kind of
buffer the code passes, continued or not; THREEFS_CRC32C picks one or says why it cannot."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import crc32c as icrar
import numpy as np
import pytest

from threefs.common import crc32c

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_fast_one_is_in_use_here():
    # pyproject.toml requires awscrt: a test environment without it would silently measure the fallback
    assert crc32c.IMPLEMENTATION == "awscrt"
    assert crc32c.crc32c(b"123456789") == crc32c.CHECK_VALUE == icrar.crc32c(b"123456789")


@pytest.mark.parametrize("size", [0, 1, 7, 63, 64, 65, 1023, 1024, 4096, 4099, 5 * 1024 + 1, 65536, 65541,
                                  (1 << 20) + 13, 4 << 20])
def test_same_values_as_icrar(size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    want = icrar.crc32c(data)
    assert crc32c.crc32c(data) == want
    assert crc32c.crc32c(bytearray(data)) == want
    assert crc32c.crc32c(memoryview(data)) == want
    assert crc32c.crc32c(np.frombuffer(data, dtype=np.uint8)) == want
    # an unaligned view into a bigger buffer (IOs checked in place in a batch's buffer)
    big = bytearray(b"\xa5" * 3) + bytearray(data) + bytearray(b"\x5a" * 5)
    assert crc32c.crc32c(memoryview(big)[3:3 + size]) == want


def test_continued_values():
    rng = random.Random(7)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(0, 20000))
        cut = rng.randrange(0, len(data) + 1)
        seed = rng.randrange(0, 1 << 32)
        want = icrar.crc32c(data[cut:], icrar.crc32c(data[:cut], seed))
        assert crc32c.crc32c(data[cut:], crc32c.crc32c(data[:cut], seed)) == want
        assert crc32c.crc32c(data[cut:], value=crc32c.crc32c(data[:cut], value=seed)) == want
    assert crc32c.crc32c(b"", value=12345) == 12345


def test_a_non_contiguous_buffer_is_refused():
    with pytest.raises((BufferError, ValueError)):
        crc32c.crc32c(memoryview(bytearray(100))[::2])


def _probe(env: dict, code: str = "") -> subprocess.CompletedProcess:
    code = code + "from threefs.common import crc32c; print(crc32c.IMPLEMENTATION, crc32c.crc32c(b'123456789'))"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})


_NO_AWSCRT = ("import sys\n"
              "class Hide:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'awscrt' or name.startswith('awscrt.') or name == '_awscrt':\n"
              "            raise ImportError('hidden by the test')\n"
              "sys.meta_path.insert(0, Hide())\n")


def test_env_picks_an_implementation():
    r = _probe({"THREEFS_CRC32C": "crc32c"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["crc32c", str(crc32c.CHECK_VALUE)]
    r = _probe({"THREEFS_CRC32C": " AWSCRT "})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["awscrt", str(crc32c.CHECK_VALUE)]


def test_fallback_when_awscrt_is_missing():
    r = _probe({"THREEFS_CRC32C": "auto"}, _NO_AWSCRT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["crc32c", str(crc32c.CHECK_VALUE)]


def test_bad_or_unavailable_choice_is_a_clear_error():
    r = _probe({"THREEFS_CRC32C": "adler"})
    assert r.returncode != 0
    assert "THREEFS_CRC32C='adler': expected one of auto, awscrt, crc32c" in r.stderr
    r = _probe({"THREEFS_CRC32C": "awscrt"}, _NO_AWSCRT)
    assert r.returncode != 0
    assert "no usable CRC32C implementation (THREEFS_CRC32C=awscrt): awscrt: not installed" in r.stderr


def test_a_buffer_over_2_gib():
    # (lengths past INT_MAX: older bindings took an int; np.zeros maps the zero page, so this costs no memory)
    big = np.zeros((2 << 30) + 4101, dtype=np.uint8)
    big[-3:] = (1, 2, 3)
    assert crc32c.crc32c(big) == icrar.crc32c(big)
    assert crc32c.crc32c(big[5:], value=77) == icrar.crc32c(big[5:], 77)


_BROKEN_AWSCRT = _NO_AWSCRT.replace("raise ImportError('hidden by the test')", "raise OSError('a broken build')")


def test_a_broken_awscrt_falls_back_or_says_so():
    r = _probe({"THREEFS_CRC32C": "auto"}, _BROKEN_AWSCRT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["crc32c", str(crc32c.CHECK_VALUE)]
    r = _probe({"THREEFS_CRC32C": "awscrt"}, _BROKEN_AWSCRT)
    assert r.returncode != 0
    assert "awscrt: cannot be loaded (OSError: a broken build)" in r.stderr
