"""The package's layers (docs/architecture.md, "Layers"): every import runs downward.

The table lives in the docs, so the docs and the tree cannot drift apart: a package missing from the
table, a table line for a package that does not exist, or an import the table does not allow fails here,
naming the file and the import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "threefs"


def layer_table() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:.*?-->\s*```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lost its layers block"
    table: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        left = line.split("|", 1)[0]
        if ":" in left:
            name, allowed = left.split(":", 1)
            table[name.strip()] = set(allowed.split())
    return table


def tree_packages() -> set[str]:
    out = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return out | {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def imports_of(path: Path):
    """(line, imported threefs module) for every import in a file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "threefs":  # from threefs import x: x is the package
                yield from ((node.lineno, f"threefs.{a.name}") for a in node.names)
            elif node.module.startswith("threefs."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("threefs."))


def test_the_table_lists_exactly_the_packages_of_the_tree():
    table, tree = layer_table(), tree_packages()
    assert set(table) == tree, (f"packages missing from docs/architecture.md: {sorted(tree - set(table))}; "
                                f"listed but not in threefs/: {sorted(set(table) - tree)}")
    for name, allowed in table.items():
        assert allowed <= set(table), f"{name} may import unknown packages {sorted(allowed - set(table))}"


def test_imports_run_downward_only():
    table = layer_table()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else None
        if src is None:
            continue  # threefs/__init__.py: the top-level `threefs.connect`, above everything
        for line, module in imports_of(path):
            dst = module.split(".")[1]
            if dst != src and dst not in table.get(src, set()):
                bad.append(f"threefs/{rel}:{line} ({src}) imports {module} ({dst})")
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)


def test_the_table_is_acyclic():
    """Allowed imports form a partial order (no two packages may import each other, even indirectly)."""
    table = layer_table()
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        assert state.get(name) != 1, f"cycle in the layer table: {' -> '.join(trail + [name])}"
        state[name] = 1
        for dep in table[name]:
            visit(dep, trail + [name])
        state[name] = 2

    for name in table:
        visit(name, [])
