"""Data sets: descriptors of partition data (file lists with optional row ranges, or in-memory tables).

Tasks pass these between each other instead of data: a task's output is a data set naming the files
it wrote. Names and constructor arguments follow smallpond.logical.dataset.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Union

import pyarrow as arrow
import pyarrow.parquet as parquet

from threefs.pond.common import DEFAULT_BATCH_SIZE, PondError, split_into_rows
from threefs.pond.io import filesystem as pfs


def _quote(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def _path_list(paths: List[str]) -> str:
    return "[" + ", ".join(_quote(pfs.data_view(p)) for p in paths) + "]"


def large_strings(table):
    """Strings come back as large_string (smallpond's convention: DuckDB's varchar is unbounded).
    Takes a table or a schema."""
    if isinstance(table, arrow.Schema):
        return arrow.schema([f.with_type(arrow.large_string()) if arrow.types.is_string(f.type) else
                             f.with_type(arrow.large_binary()) if arrow.types.is_binary(f.type) else f
                             for f in table], metadata=table.metadata)
    fields = []
    changed = False
    for f in table.schema:
        if arrow.types.is_string(f.type):
            fields.append(f.with_type(arrow.large_string()))
            changed = True
        elif arrow.types.is_binary(f.type):
            fields.append(f.with_type(arrow.large_binary()))
            changed = True
        else:
            fields.append(f)
    if not changed:
        return table
    return table.cast(arrow.schema(fields, metadata=table.schema.metadata))


@dataclass(frozen=True)
class RowRange:
    """Rows [begin, end) of one file holding `file_num_rows` rows."""
    path: str
    begin: int
    end: int
    file_num_rows: int

    @property
    def num_rows(self) -> int:
        return self.end - self.begin

    @property
    def whole_file(self) -> bool:
        return self.begin == 0 and self.end == self.file_num_rows


class DataSet:
    """The base class: a list of paths (globs allowed), resolved lazily."""

    def __init__(self, paths: Union[str, List[str]], root_dir: Optional[str] = "", recursive=False,
                 columns: Optional[List[str]] = None, union_by_name=False) -> None:
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        self.paths = [os.fspath(p) for p in self.paths]
        self.root_dir = os.path.abspath(root_dir) if root_dir not in (None, "") and not pfs.is_threefs(root_dir) \
            else (root_dir or "")
        self.recursive = recursive
        self.columns = columns
        self.union_by_name = union_by_name
        self._resolved_paths: Optional[List[str]] = None
        self._num_rows: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.__class__.__name__}: paths[{len(self.paths)}]={self.paths[:3]}..., root_dir={self.root_dir}"

    __repr__ = __str__

    @property
    def resolved_paths(self) -> List[str]:
        if self._resolved_paths is None:
            self._resolved_paths = self._resolve()
        return self._resolved_paths

    def _resolve(self) -> List[str]:
        out: List[str] = []
        for p in self.paths:
            if self.root_dir and not os.path.isabs(p) and not pfs.is_threefs(p):
                p = os.path.join(self.root_dir, p)
            if pfs.isdir(p):
                pattern = os.path.join(p, "**", f"*{self._suffix()}") if self.recursive else os.path.join(p, f"*{self._suffix()}")
                out.extend(pfs.glob(pattern, recursive=self.recursive))
            elif any(c in p for c in "*?["):
                found = pfs.glob(p, recursive=self.recursive)
                out.extend(found)
            else:
                out.append(p)
        return out

    def _suffix(self) -> str:
        return ""

    @property
    def num_files(self) -> int:
        return len(self.resolved_paths)

    @property
    def empty(self) -> bool:
        return self.num_files == 0

    @property
    def num_rows(self) -> int:
        if self._num_rows is None:
            import duckdb
            con = duckdb.connect(":memory:")
            _register_fs(con, self.resolved_paths)
            self._num_rows = con.execute(f"select count(*) from {self.sql_query_fragment()}").fetchone()[0]
        return self._num_rows

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        raise NotImplementedError

    # -- loading --------------------------------------------------------------------------------
    def to_arrow_table(self, max_workers=16, filesystem=None, conn=None) -> arrow.Table:
        import duckdb
        con = conn or duckdb.connect(":memory:")
        _register_fs(con, self.resolved_paths)
        from threefs.pond.execution.task import fetch_arrow
        return large_strings(fetch_arrow(con.sql(f"select * from {self.sql_query_fragment(conn=con)}")))

    def to_batch_reader(self, batch_size=DEFAULT_BATCH_SIZE, filesystem=None, conn=None) -> arrow.RecordBatchReader:
        table = self.to_arrow_table()
        return arrow.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=batch_size))

    def to_pandas(self):
        return self.to_arrow_table().to_pandas()

    # -- partitioning ---------------------------------------------------------------------------
    def partition_by_files(self, npartition: int, random_shuffle: bool = False) -> List["DataSet"]:
        import random
        paths = list(self.resolved_paths)
        if random_shuffle:
            random.Random(len(paths)).shuffle(paths)
        sizes = split_into_rows(len(paths), npartition)
        out, pos = [], 0
        for s in sizes:
            out.append(self._with_paths(paths[pos:pos + s]))
            pos += s
        return out

    def partition_by_size(self, max_partition_size: int) -> List["DataSet"]:
        return [self._with_paths([p]) for p in self.resolved_paths]

    def _with_paths(self, paths: List[str]) -> "DataSet":
        ds = self.__class__.__new__(self.__class__)
        ds.__dict__.update(self.__dict__)
        ds.paths = list(paths)
        ds.root_dir = ""
        ds.recursive = False
        ds._resolved_paths = list(paths)
        ds._num_rows = None
        return ds

    @staticmethod
    def merge(datasets: "List[DataSet]") -> "DataSet":
        """One data set holding the files of all `datasets` (all of the same class)."""
        datasets = [d for d in datasets if d is not None]
        if not datasets:
            return ParquetDataSet([])
        first = datasets[0]
        if len(datasets) == 1:
            return first
        if all(isinstance(d, ParquetDataSet) for d in datasets):
            return ParquetDataSet._merge_parquet(datasets)
        if all(isinstance(d, (ArrowTableDataSet, PandasDataSet)) for d in datasets):
            return ArrowTableDataSet(arrow.concat_tables([d.to_arrow_table() for d in datasets], promote_options="default"))
        if all(type(d) is type(first) for d in datasets):
            return first._with_paths([p for d in datasets for p in d.resolved_paths])
        raise PondError(f"cannot merge data sets of different kinds: {sorted({type(d).__name__ for d in datasets})}")


def _register_fs(con, paths: List[str]) -> None:
    if any(pfs.is_threefs(p) for p in paths):
        pfs.register_with_duckdb(con)


class PartitionedDataSet(DataSet):
    """The output of a partition producer: one data set per output partition."""

    def __init__(self, datasets: List[DataSet]) -> None:
        super().__init__([])
        self.datasets = list(datasets)

    def __getitem__(self, key: int) -> DataSet:
        return self.datasets[key]

    def __len__(self) -> int:
        return len(self.datasets)

    @property
    def resolved_paths(self) -> List[str]:
        return [p for d in self.datasets for p in d.resolved_paths]

    @property
    def num_rows(self) -> int:
        return sum(d.num_rows for d in self.datasets)


class ParquetDataSet(DataSet):
    """Parquet files, optionally restricted to row ranges (partition_by_rows)."""

    def __init__(self, paths: Union[str, List[str]], root_dir: Optional[str] = "", recursive=False,
                 columns: Optional[List[str]] = None, generated_columns: Optional[List[str]] = None,
                 union_by_name=False) -> None:
        super().__init__(paths, root_dir, recursive, columns, union_by_name)
        self.generated_columns = list(generated_columns or [])
        self.row_ranges: Optional[List[RowRange]] = None
        self._file_rows: Optional[Dict[str, int]] = None

    def _suffix(self) -> str:
        return ".parquet"

    @classmethod
    def _merge_parquet(cls, datasets: "List[ParquetDataSet]") -> "ParquetDataSet":
        first = datasets[0]
        out = first._with_paths([p for d in datasets for p in d.resolved_paths])
        out.union_by_name = any(d.union_by_name for d in datasets)
        if any(d.row_ranges is not None for d in datasets):
            out.row_ranges = [r for d in datasets for r in d.resolved_row_ranges]
        else:
            out.row_ranges = None
        rows = {}
        for d in datasets:
            rows.update(d._file_rows or {})
        out._file_rows = rows or None
        return out

    def _with_paths(self, paths):
        ds = super()._with_paths(paths)
        ds.row_ranges = None
        return ds

    @property
    def file_num_rows(self) -> Dict[str, int]:
        """Row count of each file, from the Parquet footers."""
        if self._file_rows is None or any(p not in self._file_rows for p in self.resolved_paths):
            rows = dict(self._file_rows or {})
            for p in self.resolved_paths:
                if p not in rows:
                    fs, path = pfs.arrow_filesystem_and_path(p)
                    if fs is None:
                        rows[p] = parquet.ParquetFile(path).metadata.num_rows
                    else:
                        with fs.open(path, "rb") as f:
                            rows[p] = parquet.ParquetFile(f).metadata.num_rows
            self._file_rows = rows
        return self._file_rows

    @property
    def resolved_row_ranges(self) -> List[RowRange]:
        if self.row_ranges is not None:
            return self.row_ranges
        rows = self.file_num_rows
        return [RowRange(p, 0, rows[p], rows[p]) for p in self.resolved_paths]

    @property
    def num_rows(self) -> int:
        if self._num_rows is None:
            self._num_rows = sum(r.num_rows for r in self.resolved_row_ranges)
        return self._num_rows

    def partition_by_rows(self, npartition: int, random_shuffle: bool = False) -> "List[ParquetDataSet]":
        """Split into npartition data sets of nearly equal row counts (ranges within files)."""
        ranges = self.resolved_row_ranges
        total = sum(r.num_rows for r in ranges)
        sizes = split_into_rows(total, npartition)
        out: List[ParquetDataSet] = []
        idx, offset = 0, ranges[0].begin if ranges else 0
        for size in sizes:
            parts: List[RowRange] = []
            while size > 0 and idx < len(ranges):
                r = ranges[idx]
                take = min(size, r.end - offset)
                if take > 0:
                    parts.append(RowRange(r.path, offset, offset + take, r.file_num_rows))
                size -= take
                offset += take
                if offset >= r.end:
                    idx += 1
                    offset = ranges[idx].begin if idx < len(ranges) else 0
            ds = self._with_paths(sorted({p.path for p in parts}, key=[r.path for r in parts].index))
            ds.row_ranges = parts
            ds._file_rows = {r.path: r.file_num_rows for r in parts}
            out.append(ds)
        return out

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        cols = ", ".join(f'"{c}"' for c in self.columns) if self.columns else "*"
        gen = "".join(f", {g}=true" for g in self.generated_columns)
        ubn = ", union_by_name=true" if self.union_by_name else ""
        if not self.resolved_paths:
            raise PondError("a data set without files has no schema to query; "
                            f"check the input paths: {self.paths[:5]}")
        ranges = self.row_ranges
        if ranges is None or all(r.whole_file for r in ranges):
            return (f"(select {cols} from read_parquet({_path_list(self.resolved_paths)}, "
                    f"hive_partitioning=false{ubn}{gen}))")
        keep_rn = "file_row_number" in self.generated_columns
        selects = []
        for r in ranges:
            if r.whole_file:
                selects.append(f"select {cols} from read_parquet({_quote(pfs.data_view(r.path))}, hive_partitioning=false{gen})")
                continue
            inner_gen = "".join(f", {g}=true" for g in self.generated_columns if g != "file_row_number")
            star = "*" if keep_rn else "* exclude (file_row_number)"
            selects.append(
                f"select {cols} from (select {star} from read_parquet({_quote(pfs.data_view(r.path))}, hive_partitioning=false, "
                f"file_row_number=true{inner_gen}) where file_row_number >= {r.begin} and file_row_number < {r.end})")
        union = " union all by name " if self.union_by_name else " union all "
        return "(" + union.join(f"({s})" for s in selects) + ")"

    def to_arrow_table(self, max_workers=16, filesystem=None, conn=None) -> arrow.Table:
        if self.generated_columns or not self.resolved_paths:
            if not self.resolved_paths:
                return arrow.table({})
            return super().to_arrow_table()
        tables = []
        for r in self.resolved_row_ranges:
            t = _read_parquet_file(r.path, self.columns)
            if not r.whole_file:
                t = t.slice(r.begin, r.num_rows)
            tables.append(t)
        if not tables:
            return arrow.table({})
        table = arrow.concat_tables(tables, promote_options="default" if self.union_by_name else "none")
        return large_strings(table.replace_schema_metadata(None))

    def to_batch_reader(self, batch_size=DEFAULT_BATCH_SIZE, filesystem=None, conn=None) -> arrow.RecordBatchReader:
        schema = None
        ranges = self.resolved_row_ranges

        def batches() -> Iterator[arrow.RecordBatch]:
            for r in ranges:
                t = _read_parquet_file(r.path, self.columns)
                if not r.whole_file:
                    t = t.slice(r.begin, r.num_rows)
                t = large_strings(t.replace_schema_metadata(None))
                yield from t.to_batches(max_chunksize=batch_size)

        if not ranges:
            return arrow.RecordBatchReader.from_batches(arrow.schema([]), iter([]))
        first = large_strings(_read_parquet_schema(ranges[0].path, self.columns))
        schema = first
        return arrow.RecordBatchReader.from_batches(schema, (b.cast(schema) if b.schema != schema else b for b in batches()))


def _read_parquet_file(path: str, columns) -> arrow.Table:
    fs, p = pfs.arrow_filesystem_and_path(path)
    if fs is None:
        return parquet.read_table(p, columns=columns, use_threads=True)
    with fs.open(p, "rb") as f:
        return parquet.read_table(f, columns=columns)


def _read_parquet_schema(path: str, columns) -> arrow.Schema:
    fs, p = pfs.arrow_filesystem_and_path(path)
    if fs is None:
        schema = parquet.read_schema(p)
    else:
        with fs.open(p, "rb") as f:
            schema = parquet.read_schema(f)
    schema = schema.remove_metadata()
    if columns:
        schema = arrow.schema([schema.field(c) for c in columns])
    return schema


class CsvDataSet(DataSet):
    """CSV files with a required schema ({column: duckdb type}) and a delimiter."""

    def __init__(self, paths: Union[str, List[str]], schema: Dict[str, str], delim=",", max_line_size: Optional[int] = None,
                 parallel=True, header=False, root_dir: Optional[str] = "", recursive=False,
                 columns: Optional[List[str]] = None, union_by_name=False) -> None:
        super().__init__(paths, root_dir, recursive, columns, union_by_name)
        if not schema:
            raise PondError("read_csv needs a schema, e.g. schema={'url': 'varchar', 'n': 'bigint'}")
        self.schema = OrderedDict(schema)
        self.delim = delim
        self.max_line_size = max_line_size
        self.parallel = parallel
        self.header = header

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        cols = ", ".join(f"{_quote(k)}: {_quote(v)}" for k, v in self.schema.items())
        proj = ", ".join(f'"{c}"' for c in self.columns) if self.columns else "*"
        mls = f", max_line_size={self.max_line_size}" if self.max_line_size else ""
        return (f"(select {proj} from read_csv({_path_list(self.resolved_paths)}, delim={_quote(self.delim)}, "
                f"columns={{{cols}}}, header={'true' if self.header else 'false'}, auto_detect=false{mls}))")


class JsonDataSet(DataSet):
    """Newline-delimited JSON files with a schema ({column: duckdb type})."""

    def __init__(self, paths: Union[str, List[str]], schema: Dict[str, str], format="newline_delimited",
                 max_object_size=1 << 24, root_dir: Optional[str] = "", recursive=False,
                 columns: Optional[List[str]] = None, union_by_name=False) -> None:
        super().__init__(paths, root_dir, recursive, columns, union_by_name)
        self.schema = OrderedDict(schema or {})
        self.format = format
        self.max_object_size = max_object_size

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        proj = ", ".join(f'"{c}"' for c in self.columns) if self.columns else "*"
        if self.schema:
            cols = ", ".join(f"{_quote(k)}: {_quote(v)}" for k, v in self.schema.items())
            return (f"(select {proj} from read_json({_path_list(self.resolved_paths)}, format={_quote(self.format)}, "
                    f"columns={{{cols}}}, maximum_object_size={self.max_object_size}))")
        return f"(select {proj} from read_json_auto({_path_list(self.resolved_paths)}, format={_quote(self.format)}))"


class ArrowTableDataSet(DataSet):
    """An in-memory Arrow table (travels inside the pickled task)."""

    def __init__(self, table: arrow.Table) -> None:
        super().__init__([])
        self.table = table
        self._num_rows = table.num_rows

    @property
    def num_files(self) -> int:
        return 1

    @property
    def empty(self) -> bool:
        return False

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        assert conn is not None, "an in-memory table needs the connection to register on"
        name = f"__arrow_{id(self.table):x}"
        conn.register(name, self.table)
        return f"(select * from {name})"

    def to_arrow_table(self, max_workers=16, filesystem=None, conn=None) -> arrow.Table:
        return self.table

    def to_batch_reader(self, batch_size=DEFAULT_BATCH_SIZE, filesystem=None, conn=None) -> arrow.RecordBatchReader:
        return arrow.RecordBatchReader.from_batches(self.table.schema, self.table.to_batches(max_chunksize=batch_size))

    def partition_by_rows(self, npartition: int, random_shuffle: bool = False) -> List["ArrowTableDataSet"]:
        sizes = split_into_rows(self.table.num_rows, npartition)
        out, pos = [], 0
        for s in sizes:
            out.append(ArrowTableDataSet(self.table.slice(pos, s)))
            pos += s
        return out

    def partition_by_files(self, npartition: int, random_shuffle: bool = False) -> List[DataSet]:
        return [self] + [ArrowTableDataSet(self.table.schema.empty_table()) for _ in range(npartition - 1)]


class PandasDataSet(ArrowTableDataSet):
    """An in-memory pandas DataFrame."""

    def __init__(self, df) -> None:
        self.df = df
        super().__init__(arrow.Table.from_pandas(df, preserve_index=False))

    def to_pandas(self):
        return self.df

    def partition_by_rows(self, npartition: int, random_shuffle: bool = False):
        sizes = split_into_rows(len(self.df), npartition)
        out, pos = [], 0
        for s in sizes:
            out.append(PandasDataSet(self.df.iloc[pos:pos + s]))
            pos += s
        return out


class SqlQueryDataSet(DataSet):
    """The result of a SQL query without inputs (e.g. `select * from range(10)`)."""

    def __init__(self, sql_query: str, query_builder=None) -> None:
        super().__init__([])
        self.sql_query = sql_query

    @property
    def num_files(self) -> int:
        return 1

    @property
    def empty(self) -> bool:
        return False

    def sql_query_fragment(self, filesystem=None, conn=None) -> str:
        return f"({self.sql_query})"
