"""User-defined functions for SQL nodes (names follow smallpond.logical.udf)."""

from __future__ import annotations

from enum import Enum
from typing import Callable, List, Optional


class UDFType(Enum):
    INTEGER = "INTEGER"
    INT = "INTEGER"
    BIGINT = "BIGINT"
    FLOAT = "FLOAT"
    DOUBLE = "DOUBLE"
    VARCHAR = "VARCHAR"
    BLOB = "BLOB"
    BOOLEAN = "BOOLEAN"
    DATE = "DATE"
    TIMESTAMP = "TIMESTAMP"

    def to_duckdb_type(self):
        import duckdb
        return duckdb.sqltype(self.value) if hasattr(duckdb, "sqltype") else self.value


class UDFContext:
    def __init__(self, name: str) -> None:
        self.name = name

    def bind(self, conn) -> None:
        raise NotImplementedError


class PythonUDFContext(UDFContext):
    def __init__(self, name: str, func: Callable, params: Optional[List[UDFType]], return_type: Optional[UDFType],
                 use_arrow_type=False) -> None:
        super().__init__(name)
        self.func, self.params, self.return_type, self.use_arrow_type = func, params, return_type, use_arrow_type

    def bind(self, conn) -> None:
        def t(x):
            return x.to_duckdb_type() if isinstance(x, UDFType) else x
        params = None if self.params is None else [t(p) for p in self.params]
        conn.create_function(self.name, self.func, params, t(self.return_type),
                             type="arrow" if self.use_arrow_type else "native")


class ExternalModuleContext(UDFContext):
    def __init__(self, name: str, module_path: str) -> None:
        super().__init__(name)
        self.module_path = module_path

    def bind(self, conn) -> None:
        import importlib.util
        spec = importlib.util.spec_from_file_location(self.name, self.module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.create_duckdb_udfs(conn)


class DuckDbExtensionContext(UDFContext):
    def __init__(self, name: str, extension_path: str) -> None:
        super().__init__(name)
        self.extension_path = extension_path

    def bind(self, conn) -> None:
        conn.load_extension(self.extension_path)


class UserDefinedFunction:
    def __init__(self, name: str, func: Callable, params, return_type, use_arrow_type=False) -> None:
        self.name, self.func, self.params, self.return_type, self.use_arrow_type = \
            name, func, params, return_type, use_arrow_type

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)


def udf(params: List[UDFType], return_type: UDFType, use_arrow_type=False, name: Optional[str] = None):
    """Decorate a Python function to use it in SQL: `df.map('gcd(a, b)', udfs=[gcd])`."""
    def wrap(func: Callable) -> UserDefinedFunction:
        return UserDefinedFunction(name or func.__name__, func, params, return_type, use_arrow_type)
    return wrap
