"""Optimizer: fuse consecutive SQL nodes into one nested query (one task, no intermediate Parquet), and
replace nodes computed earlier in the session by their results."""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

from threefs.pond.logical.dataset import DataSet
from threefs.pond.logical.node import LimitNode, Node, SqlEngineNode


class Optimizer:
    def __init__(self, exclude_nodes: Optional[set] = None, computed: Optional[Dict[int, List[DataSet]]] = None) -> None:
        self.exclude = set(exclude_nodes or ())
        self.computed = computed or {}
        self.memo: Dict[int, Node] = {}

    def visit(self, node: Node) -> Node:
        if node.id in self.memo:
            return self.memo[node.id]
        if node.id in self.computed:
            from threefs.pond.logical.planner import ComputedNode
            out: Node = ComputedNode(node.ctx, node, self.computed[node.id])
        else:
            deps = tuple(self.visit(d) for d in node.input_deps)
            out = node if deps == node.input_deps else _with_deps(node, deps)
            out = self._fuse(out)
        self.memo[node.id] = out
        return out

    def _fuse(self, node: Node) -> Node:
        if not _fusable(node) or len(node.input_deps) != 1:
            return node
        inner = node.input_deps[0]
        if not _fusable(inner) or inner.id in self.exclude or inner.id in self.computed:
            return node
        fused = copy.copy(node)
        fused.input_deps = inner.input_deps
        fused.sql_queries = [node.sql_queries[0].replace("{0}", f"({inner.sql_queries[0]})")]
        fused.cpu_limit = max(node.cpu_limit, inner.cpu_limit)
        fused.fused_from = getattr(node, "fused_from", [node.id]) + getattr(inner, "fused_from", [inner.id])
        return fused


def _fusable(node: Node) -> bool:
    return (type(node) is SqlEngineNode and not isinstance(node, LimitNode) and len(node.sql_queries) == 1
            and not node.udfs and "{1}" not in node.sql_queries[0])


def _with_deps(node: Node, deps) -> Node:
    out = copy.copy(node)
    out.input_deps = deps
    return out
