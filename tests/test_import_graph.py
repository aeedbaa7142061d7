"""The shape of ``src/kvpage``: a full layer order, no import cycle, a torch-free bookkeeping core.

Layers, lowest first (:data:`LAYERS`): {errors, config_json} < formats < scales < spec < ops < model < cache < engine
< {server, eval, integrations} < cli, with the package ``kvpage`` itself (its ``__init__``, which
re-exports) on top. A module may import only from its own layer or a lower one; server, eval and
integrations share a rank and import none of each other. The design (``design.md``, "Layers") and the
README's module table say the same in words.

The graph is built from the source with :mod:`ast` (nothing is imported): one node per module
(a package is its ``__init__``), one edge per import statement anywhere in the module, at module
level or inside a function (a lazy import is still a dependency). ``import a.b.c`` and
``from a.b import c`` point at the most specific module that exists (``a.b.c`` when it is a
module, else ``a.b``). The parent packages Python runs first are not edges: a package whose
``__init__`` imports its own submodules is not a cycle. Imports under ``if TYPE_CHECKING:`` are
left out of the cycle check (they never run) but not out of the layer rule (a lower layer must not
even name an upper one's types).

Every rule is a function of the edges (or of a parsed module), and each has a self-check on made-up
input, so a rule that can no longer fail is caught too.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "kvpage"

#: The layers, lowest first; the packages of one tuple share a rank and must not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvpage.errors", "kvpage.config_json"),
    ("kvpage.formats",),
    ("kvpage.scales",),
    ("kvpage.spec",),
    ("kvpage.ops",),
    ("kvpage.model",),
    ("kvpage.cache",),
    ("kvpage.engine",),
    ("kvpage.server", "kvpage.eval", "kvpage.integrations"),
    ("kvpage.cli",),
)
#: The package itself (``kvpage/__init__.py``): above every layer, it may re-export any of them.
TOP = ROOT

#: Scheduler-side bookkeeping: decides with plain integers, so it imports no ``torch`` (design.md, layer 3).
#: Each entry is a module, or ``package.*`` for a package and every module under it. Add a module here
#: once it is torch-free; never take one out to let it import torch (move the tensor work to the
#: controller or the worker side instead).
TORCH_FREE: tuple[str, ...] = (
    "kvpage.config_json",
    "kvpage.cache",
    "kvpage.cache.idpool",
    "kvpage.cache.prefix_cache",
    "kvpage.cache.prefix_index",
    "kvpage.cache.hashing",
    "kvpage.cache.block_table",
    "kvpage.cache.requests",
    "kvpage.cache.events",
    "kvpage.cache.kv_events.*",
    "kvpage.cache.kv_cache",
    "kvpage.cache.step_plan",
    "kvpage.cache.capacity",
    "kvpage.cache.groups.*",
    "kvpage.cache.tail",
    "kvpage.cache.tail.entries",
    "kvpage.cache.tail.side",
    "kvpage.cache.tail.table",
    "kvpage.cache.tiers",
    "kvpage.cache.tiers.connector",
    "kvpage.cache.tiers.offload",
    "kvpage.cache.tiers.transfer",
    "kvpage.cache.tiers.host_pool",
    "kvpage.cache.tiers.policy",
    "kvpage.cache.tiers.types",
    "kvpage.engine.scheduler",
)

#: A guard against files nobody can read, not a design rule. The project's rule is to split a module by
#: concept, never by line count: a mixin or helper module made only to stay under a size limit is worse
#: than a long module (issue 27). Raised from 500 for the cache/engine rewrite (issue 27).
MAX_LINES = 1000


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


def layer_of(module: str) -> tuple[int, str] | None:
    """``(rank, layer package)`` of a kvpage module; the package itself is ``(len(LAYERS), "kvpage")``; ``None``: no layer."""
    if module == TOP:
        return len(LAYERS), TOP
    for rank, peers in enumerate(LAYERS):
        for layer in peers:
            if _within(module, layer):
                return rank, layer
    return None


def _where(e: Edge) -> str:
    """``src/kvpage/.../x.py:LINE`` for an edge of a real module, else ``module:LINE`` (made-up edges)."""
    path = module_files().get(e.src)
    return f"{path.relative_to(SRC.parent) if path else e.src}:{e.line}"


def layer_violations(edges: list[Edge]) -> list[str]:
    """One line per import that reaches up the layer order or across to a peer (``TYPE_CHECKING`` ones too).

    An edge is fine when both ends are in the same layer package, or the target's rank is lower.
    Modules in no layer are :func:`unlayered`'s business and are skipped here.
    """
    bad = set()
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is None or dst is None or src[1] == dst[1] or dst[0] < src[0]:
            continue
        how = "a peer" if dst[0] == src[0] else "a higher layer"
        bad.add(f"{_where(e)}: {e.src} ({src[1]}) imports {e.dst} ({how}: {dst[1]})"
                + (" under TYPE_CHECKING" if e.type_only else ""))
    return sorted(bad)


def unlayered(modules: list[str]) -> list[str]:
    """The modules that belong to no layer of :data:`LAYERS` (a new top-level module must be placed)."""
    return sorted(m for m in modules if layer_of(m) is None)


def cache_engine_edges(edges: list[Edge]) -> list[str]:
    """Every import of ``kvpage.engine`` from ``kvpage.cache`` (``TYPE_CHECKING`` ones too)."""
    return sorted({f"{_where(e)}: {e.src} imports {e.dst}" + (" under TYPE_CHECKING" if e.type_only else "")
                   for e in edges if _within(e.src, "kvpage.cache") and _within(e.dst, "kvpage.engine")})


def torch_imports(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that import ``torch`` or a submodule of it, anywhere (lazy and ``TYPE_CHECKING`` ones too)."""
    lines = []
    for node, _ in _imports(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if not (isinstance(node, ast.ImportFrom) and node.level) and any(_within(n, "torch") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def torch_free_modules(modules: dict[str, Path]) -> tuple[list[str], list[str]]:
    """:data:`TORCH_FREE` expanded over ``modules``: ``(modules, entries that name nothing)``."""
    found, missing = [], []
    for entry in TORCH_FREE:
        if entry.endswith(".*"):
            names = [m for m in modules if _within(m, entry[:-2])]
        else:
            names = [entry] if entry in modules else []
        found += names
        if not names:
            missing.append(entry)
    return sorted(set(found)), missing


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


def test_the_layer_rule_flags_upward_and_peer_imports_and_passes_downward_ones() -> None:
    e = lambda src, dst, type_only=False: Edge(src, dst, 7, type_only)  # noqa: E731
    ok = [e("kvpage.engine.llm", "kvpage.cache.manager"), e("kvpage.cache.manager", "kvpage.cache.idpool"),
          e("kvpage.cli.generate", "kvpage.eval.command"), e("kvpage.cli", "kvpage.errors"),
          e("kvpage.server.app", "kvpage.engine.llm"), e("kvpage", "kvpage.cli"), e("kvpage.spec", "kvpage.formats")]
    assert layer_violations(ok) == []
    up = [e("kvpage.cache.manager", "kvpage.engine.llm"), e("kvpage.model.decoder", "kvpage.cache.idpool", True),
          e("kvpage.eval.command", "kvpage.cli"), e("kvpage.formats.base", "kvpage.spec"), e("kvpage.cli", "kvpage")]
    peers = [e("kvpage.eval.perplexity", "kvpage.server.app"), e("kvpage.integrations.x", "kvpage.eval")]
    got = layer_violations(up + peers)
    assert len(got) == len(up) + len(peers)
    assert ("src/kvpage/model/decoder.py:7: kvpage.model.decoder (kvpage.model) imports kvpage.cache.idpool "
            "(a higher layer: kvpage.cache) under TYPE_CHECKING") in got
    assert sum("(a peer: " in line for line in got) == 2
    assert layer_of("kvpage.errors") == (0, "kvpage.errors") and layer_of("kvpage.cli.generate")[0] == len(LAYERS) - 1
    assert layer_of("kvpage.eval")[0] == layer_of("kvpage.server.app")[0] == layer_of("kvpage.integrations")[0]
    assert unlayered(["kvpage.calibration", "kvpage.flag_types", "kvpage.spec", "kvpage", "kvpage.specs"]) == [
        "kvpage.calibration", "kvpage.flag_types", "kvpage.specs"]


def test_the_cache_engine_rule_flags_only_cache_importing_engine() -> None:
    made_up = [Edge("kvpage.cache.kv_cache", "kvpage.engine.config", 3, True),
               Edge("kvpage.cache", "kvpage.engine", 4, False),
               Edge("kvpage.engine.scheduler", "kvpage.cache.kv_cache", 5, False),
               Edge("kvpage.cachefoo", "kvpage.engine", 6, False)]
    assert cache_engine_edges(made_up) == [
        "src/kvpage/cache/__init__.py:4: kvpage.cache imports kvpage.engine",
        "src/kvpage/cache/kv_cache.py:3: kvpage.cache.kv_cache imports kvpage.engine.config under TYPE_CHECKING"]


def test_the_torch_rule_sees_every_kind_of_torch_import() -> None:
    tree = ast.parse(
        "import os\nimport torchvision\nfrom .torch import x\nimport numpy as torch\n"
        "import torch\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torch import Tensor\n"
        "def f():\n    import torch.nn.functional as F\n"
        "class C:\n    def g(self):\n        from torch.nn import Module\n"
    )
    assert torch_imports(tree) == [5, 8, 10, 13]
    assert torch_imports(ast.parse("import os\nfrom kvpage.cache import idpool\n")) == []
    found, missing = torch_free_modules(module_files())
    assert "kvpage.cache.groups.base" in found and "kvpage.cache.groups" in found and "kvpage.cache.idpool" in found
    assert not any(_within(m, "kvpage.cache.controller") for m in found)
    assert torch_free_modules({"kvpage.cache.idpool": SRC})[1] == [e for e in TORCH_FREE if e != "kvpage.cache.idpool"]


# -- the rules ---------------------------------------------------------------------------------


def test_no_import_cycle_among_kvpage_modules() -> None:
    cycles = find_cycles([e for e in import_edges() if not e.type_only])
    detail = []
    for comp in cycles:
        members = set(comp)
        inside = [e for e in import_edges() if not e.type_only and e.src in members and e.dst in members]
        detail.append(" <-> ".join(comp) + "\n    " + "\n    ".join(f"{e.src}:{e.line} imports {e.dst}" for e in inside))
    assert not cycles, "import cycles (break each by moving the shared part down a layer):\n" + "\n".join(detail)


def test_every_module_has_a_layer() -> None:
    lost = unlayered(list(module_files()))
    assert not lost, ("modules in no layer (move each into the layer package it belongs to, or add the package to "
                      "LAYERS):\n" + "\n".join(lost))


def test_a_module_imports_only_its_own_layer_or_lower_ones() -> None:
    bad = layer_violations(import_edges())
    order = " < ".join("{" + ", ".join(p) + "}" if len(p) > 1 else p[0] for p in LAYERS)
    assert not bad, (f"imports against the layer order {order} < kvpage (move the shared part down, or pass it "
                     f"in from above):\n" + "\n".join(bad))


def test_cache_never_imports_engine() -> None:
    bad = cache_engine_edges(import_edges())
    assert not bad, ("kvpage.cache imports kvpage.engine: the cache sits below the engine and must work without it "
                     "(move what both need into kvpage.cache or lower, or have the engine pass it in):\n"
                     + "\n".join(bad))


def test_scheduler_side_bookkeeping_imports_no_torch() -> None:
    modules = module_files()
    names, missing = torch_free_modules(modules)
    assert not missing, f"TORCH_FREE names modules that do not exist (renamed or moved? update the list): {missing}"
    bad = [f"{modules[m].relative_to(SRC.parent)}:{line}: {m} imports torch"
           for m in names for line in torch_imports(ast.parse(modules[m].read_text(encoding="utf-8")))]
    assert not bad, ("scheduler-side bookkeeping must stay torch-free (plain ids; tensors belong to the controller "
                     "and the worker side):\n" + "\n".join(bad))


def test_no_module_over_max_lines() -> None:
    sizes = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in module_files().items()}
    big = [f"{module_files()[m].relative_to(SRC.parent)}: {n} lines" for m, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split each by concept, never by line count):\n" + "\n".join(big)
