"""CRC32C (Castagnoli), the checksum of every chunk, IO and record threefs keeps or checks.

    from threefs.common import crc32c
    crc32c.crc32c(data)             # of a bytes-like object (C-contiguous)
    crc32c.crc32c(more, value=crc)  # continued: crc32c(a + b) == crc32c(b, value=crc32c(a))

Two implementations give the same values; the faster one that is installed is used:
  awscrt   AWS's aws-checksums (package `awscrt`): folds with carry-less multiplies (PCLMULQDQ, and
           VPCLMULQDQ on AVX-512 machines); lets go of the GIL over 5 KiB
  crc32c   ICRAR's `crc32c`: the SSE4.2 crc32 instruction on three streams (the implementation until
           2026-12; it stays as the fallback)
`benchmarks/checksums.py`, one process, min of 5: 4 KiB 0.17 against 0.29 us, 64 KiB 0.95 against 3.3 us,
1 MiB 12 against 45 us; under 1 KiB awscrt costs ~0.02-0.05 us more (the call is all there is). Every read
checks each IO's crc32c on arrival and storage checksums every read and write, so this is on every byte's
path: sequential batch_read 1.07x, random 64 KiB 1.12x with awscrt (docs/storage.md, "Integrity").

THREEFS_CRC32C=auto (default) | awscrt | crc32c picks one explicitly (e.g. to compare them); a named one
that is not installed, fails to load or does not give the known answer at import is an error that says
which (auto goes on to the next one). `IMPLEMENTATION` names the one in use.
"""

from __future__ import annotations

import os

CHECK_VALUE = 0xE3069283  # crc32c(b"123456789"), the catalogue check value of CRC-32C (iSCSI)
_CHOICES = ("auto", "awscrt", "crc32c")


def _from_awscrt():
    from awscrt import checksums

    native = getattr(getattr(checksums, "_awscrt", None), "checksums_crc32c", None)
    if native is None:  # (a future awscrt without the extension function: its public wrapper)
        native = checksums.crc32c

    def crc32c(data, value: int = 0) -> int:
        return native(data, value)

    return crc32c


def _from_icrar():
    import crc32c as icrar  # (the third-party package, not this module: imports are absolute)

    return icrar.crc32c  # crc32c(data, value=0, gil_release_mode=-1)


def _pick(choice: str):
    if choice not in _CHOICES:
        raise ValueError(f"THREEFS_CRC32C={choice!r}: expected one of {', '.join(_CHOICES)}")
    tried = []
    for name, load in (("awscrt", _from_awscrt), ("crc32c", _from_icrar)):
        if choice not in ("auto", name):
            continue
        try:
            fn = load()
        except ImportError as e:
            tried.append(f"{name}: not installed ({e})")
            continue
        except Exception as e:  # (a broken install: its extension fails to load)
            tried.append(f"{name}: cannot be loaded ({type(e).__name__}: {e})")
            continue
        if fn(b"123456789") == CHECK_VALUE and fn(b"56789", value=fn(b"1234")) == CHECK_VALUE:
            return name, fn
        tried.append(f"{name}: wrong answer for the check value")
    raise ImportError(f"no usable CRC32C implementation (THREEFS_CRC32C={choice}): " + "; ".join(tried))


IMPLEMENTATION, crc32c = _pick(os.environ.get("THREEFS_CRC32C", "auto").strip().lower() or "auto")
