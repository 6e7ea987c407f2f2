"""The shape of the library code: no import cycles, functions that fit on a screen, one
namespace. Read from the source with `ast`, so nothing is imported or run."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# sluice/ holds the four top-level folders as symlinks (sluice.buffer is buffer/, ...).
LIBRARY = ROOT / "sluice"
MAX_FUNCTION_LINES = 60


def library_modules() -> dict[str, Path]:
    modules = {}
    paths = [Path(d) / f for d, _, files in os.walk(LIBRARY, followlinks=True) for f in files]
    for path in sorted(p for p in paths if p.suffix == ".py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test) if test else False


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every module `module` imports, at the top or inside a function (a lazy import breaks no
    cycle that matters to a reader), leaving out `if TYPE_CHECKING:` blocks."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip: set[int] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if _type_checking_block(node):
            skip.update(id(n) for n in ast.walk(node))
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> nx.DiGraph:
    modules = library_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for target in imported_names(module, path):
            if target in modules and target != module:
                graph.add_edge(module, target)
    return graph


def test_the_library_has_no_import_cycle():
    graph = import_graph()
    assert graph.number_of_edges() > 100  # the walk found the imports
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from pkg.b import g\n")
    b.write_text("from pkg import a\n")
    assert list(imported_names("pkg.a", a)) == ["pkg.b", "pkg.b.g"]
    assert "pkg.a" in list(imported_names("pkg.b", b))


def long_functions() -> Iterator[str]:
    for module, path in library_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    yield f"{module}.{node.name}: {lines} lines ({path.relative_to(ROOT)}:{node.lineno})"


def test_library_functions_fit_on_a_screen():
    too_long = list(long_functions())
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


@pytest.mark.parametrize("folder", ["buffer", "learner", "rollout_svc", "weight_sync"])
def test_top_level_folders_are_in_the_sluice_namespace(folder):
    link = LIBRARY / folder
    assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve()
    assert f"sluice.{folder}" in library_modules()
