"""threefs.pond: smallpond-compatible data processing on DuckDB, over threefs or a local disk.

    import threefs.pond as smallpond
    sp = smallpond.init(data_root="/mnt/threefs/pond")          # a local process pool; ray_address= for Ray
    df = sp.read_parquet("prices/*.parquet").repartition(8, hash_by="ticker")
    df = sp.partial_sql("select ticker, min(price), max(price) from {0} group by ticker", df)
    df.write_parquet("output/")
    print(df.to_pandas())                                        # reads what write_parquet wrote

See docs/pond.md.
"""

from __future__ import annotations

__version__ = "0.15.0+pond"

from threefs.pond.common import PondError, TaskFailedError, UnschedulableError  # noqa: E402
from threefs.pond.dataframe import DataFrame, Session  # noqa: E402
from threefs.pond.logical.udf import UDFType, udf  # noqa: E402


def init(job_id=None, job_time=None, job_name=None, data_root=None, num_executors=None, ray_address=None,
         bind_numa_node=None, platform=None, _remove_output_root=True, **kwargs) -> Session:
    """Start a session. Explicit arguments win over the SP_* environment variables (SP_JOBID, SP_JOB_TIME,
    SP_DATA_ROOT, SP_NUM_EXECUTORS, SP_RAY_ADDRESS), which fill in what is left out.

    pond keywords: executor ("local" | "ray"; default ray when ray_address is given), num_cpus (local worker
    processes), memory (bytes a local executor offers), progress (bars on stderr), max_retry_count,
    max_fail_count."""
    return Session(job_id=job_id, job_time=job_time, job_name=job_name, data_root=data_root,
                   num_executors=num_executors, ray_address=ray_address, bind_numa_node=bind_numa_node,
                   platform=platform, _remove_output_root=_remove_output_root, **kwargs)


__all__ = ["init", "Session", "DataFrame", "PondError", "TaskFailedError", "UnschedulableError", "udf", "UDFType"]
