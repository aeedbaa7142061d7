"""The shape of ``src/kvpage``: no import cycle, lower layers never import upper ones, no module over 500 lines.

The graph is built from the source with :mod:`ast` (nothing is imported): one node per module
(a package is its ``__init__``), one edge per import statement anywhere in the module, at module
level or inside a function (a lazy import is still a dependency). ``import a.b.c`` and
``from a.b import c`` point at the most specific module that exists (``a.b.c`` when it is a
module, else ``a.b``). The parent packages Python runs first are not edges: a package whose
``__init__`` imports its own submodules is not a cycle. Imports under ``if TYPE_CHECKING:`` are
left out of the cycle check (they never run) but not out of the layer rule (a lower layer must not
even name an upper one's types).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "kvpage"

#: Lower layers and what they must not import.
LOWER = ("kvpage.formats", "kvpage.spec", "kvpage.scales", "kvpage.errors", "kvpage.model", "kvpage.ops")
UPPER = ("kvpage.cache", "kvpage.engine", "kvpage.server")

MAX_LINES = 500


@dataclass(frozen=True)
class Edge:
    """One import: ``src`` imports ``dst`` at ``line``; ``type_only`` under ``if TYPE_CHECKING:``."""

    src: str
    dst: str
    line: int
    type_only: bool


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``src/kvpage``."""
    out: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import node in ``tree`` with whether it sits under ``if TYPE_CHECKING:`` (its body, not its else)."""

    def walk(node: ast.AST, type_only: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, True)
            for child in node.orelse:
                yield from walk(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, type_only)

    yield from walk(tree, False)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific existing module of dotted ``name`` (``None`` outside kvpage)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges() -> list[Edge]:
    """Every import from one kvpage module of another (see the module docstring)."""
    modules = module_files()
    edges: list[Edge] = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, type_only in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in modules else pkg for a in node.names]
            for t in targets:
                if not _within(t, ROOT):
                    continue
                dst = _resolve(t, modules)
                if dst is not None and dst != mod:
                    edges.append(Edge(mod, dst, node.lineno, type_only))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(sccs)


# -- the checker checks what it should ---------------------------------------------------------


def test_the_checker_sees_lazy_and_type_only_imports_and_finds_a_cycle() -> None:
    modules = module_files()
    assert {"kvpage", "kvpage.cache.idpool", "kvpage.cache.tiers.stores"} <= set(modules)
    edges = import_edges()
    by_src = {(e.src, e.dst): e for e in edges}
    # a function-level (lazy) import is an edge: open_store's redis import
    assert ("kvpage.cache.tiers.stores", "kvpage.cache.tiers.stores.redis") in by_src
    assert ("kvpage.cache.prefix_cache", "kvpage.cache.idpool") in by_src
    made_up = [Edge("a", "b", 1, False), Edge("b", "c", 1, False), Edge("c", "a", 1, False), Edge("c", "d", 1, False)]
    assert find_cycles(made_up) == [["a", "b", "c"]]
    assert find_cycles(made_up[1:]) == []


def test_type_checking_blocks_are_marked() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import kvpage.spec\n"
        "if TYPE_CHECKING:\n    from kvpage.cache import manager\nelse:\n    import kvpage.errors\n"
        "def f():\n    import kvpage.ops\n"
    )
    got = [(n.module if isinstance(n, ast.ImportFrom) else n.names[0].name, t) for n, t in _imports(tree)]
    assert got == [("typing", False), ("kvpage.spec", False), ("kvpage.cache", True), ("kvpage.errors", False),
                   ("kvpage.ops", False)]


# -- the rules ---------------------------------------------------------------------------------


def test_no_import_cycle_among_kvpage_modules() -> None:
    cycles = find_cycles([e for e in import_edges() if not e.type_only])
    detail = []
    for comp in cycles:
        members = set(comp)
        inside = [e for e in import_edges() if not e.type_only and e.src in members and e.dst in members]
        detail.append(" <-> ".join(comp) + "\n    " + "\n    ".join(f"{e.src}:{e.line} imports {e.dst}" for e in inside))
    assert not cycles, "import cycles (break each by moving the shared part down a layer):\n" + "\n".join(detail)


def test_lower_layers_import_nothing_from_cache_engine_or_server() -> None:
    bad = [
        f"{e.src}:{e.line} imports {e.dst}" + (" (under TYPE_CHECKING)" if e.type_only else "")
        for e in import_edges()
        if any(_within(e.src, low) for low in LOWER) and any(_within(e.dst, up) for up in UPPER)
    ]
    assert not bad, "lower layers (formats, spec, scales, errors, model, ops) reach up:\n" + "\n".join(bad)


def test_no_module_over_500_lines() -> None:
    sizes = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in module_files().items()}
    big = [f"{module_files()[m].relative_to(SRC.parent)}: {n} lines" for m, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split each by concept):\n" + "\n".join(big)
