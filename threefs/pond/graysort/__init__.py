"""GraySort on pond and threefs (docs/graysort.md): gensort-compatible 100-byte records, the two-phase sort
(partition by key range through shuffle files, then sort each partition) and valsort, as pond jobs."""

from threefs.pond.graysort.job import Fault, Manifest, Validation, combine_validation  # noqa: F401
from threefs.pond.graysort.records import RECORD, checksum, gensort as generate  # noqa: F401
from threefs.pond.graysort.run import SortReport, gensort, graysort, valsort  # noqa: F401

__all__ = ["gensort", "graysort", "valsort", "generate", "checksum", "Fault", "Manifest", "Validation",
           "SortReport", "RECORD", "combine_validation"]
