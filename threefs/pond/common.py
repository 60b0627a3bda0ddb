"""Constants and errors shared by every layer of pond (names follow smallpond.common)."""

from __future__ import annotations

KB = 1024
MB = 1024 * KB
GB = 1024 * MB
TB = 1024 * GB

DATA_PARTITION_COLUMN_NAME = "__data_partition__"
DEFAULT_BATCH_SIZE = 122880
DEFAULT_ROW_GROUP_SIZE = 122880
DEFAULT_MAX_RETRY_COUNT = 3          # attempts of a task whose executor died (killed, OOM)
DEFAULT_MAX_FAIL_COUNT = 2           # attempts of a task that raised an exception
GENERATED_COLUMNS = ("filename", "file_row_number")
MAX_PARTITIONS = 1 << 20             # a plan with more output partitions is refused


class PondError(Exception):
    """An error a user can act on: bad arguments, a failed task, an impossible request."""


class TaskFailedError(PondError):
    """A task failed after all its attempts; the message carries the task's own error."""


class UnschedulableError(PondError):
    """A task asks for more CPUs or memory than any executor has: it could never run."""


def split_into_rows(total: int, n: int) -> list[int]:
    """Sizes of n nearly equal parts of `total` items (the first ones are one larger)."""
    assert n > 0
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split_into_cols(items: list, n: int) -> list[list]:
    """Split `items` into n contiguous chunks of nearly equal length."""
    sizes = split_into_rows(len(items), n)
    out, pos = [], 0
    for s in sizes:
        out.append(items[pos:pos + s])
        pos += s
    return out
