"""The import graph of ``specjet`` (and of ``bench``): no circles, no upward arrows.

Every ``import`` and ``from ... import`` of every module is read with ``ast``, at module level and
inside functions alike; relative imports are resolved, and ``from pkg import name`` counts as an
import of ``pkg.name`` where that is a module. Two rules:

- no import cycle between modules, counting only the imports that run when a module is imported
  (module level, class bodies included); one inside a function runs later, when the importing
  module is complete, and one under ``if TYPE_CHECKING:`` never runs. A stricter check counts the
  imports inside functions too: a circle closed by a deferred import still ties the two modules
  together (it is how ``kernels.attention`` and ``kernels.triton_attention`` once were);
- every import, deferred or not, follows the layering below: a module imports its own package's
  modules and packages of a strictly lower rank, never a higher one, never a peer of its own rank
  (except the pairs in ``SAME_RANK_ALLOWED``).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The layers of specjet, top to bottom: package -> rank. A module belongs to the longest package
# that prefixes its name ("specjet" itself only to the package's __init__).
RANKS = {
    "specjet": 6,  # the public package: Engine, SamplingParams
    "specjet.demo": 6,
    "specjet.train": 6,
    "specjet.serve": 6,
    "specjet.engine": 5,
    "specjet.scheduler": 4,
    "specjet.spec_v2": 3,
    "specjet.models": 2,
    "specjet.grammar": 2,
    "specjet.kernels": 1,
    "specjet.arg_types": 0,  # the command lines' argparse types: standard library only
}
# Same-rank imports that are allowed (importer package, imported package): the programs use the
# public package. Every other pair of equal rank are peers that must not import each other.
SAME_RANK_ALLOWED = {("specjet.demo", "specjet"), ("specjet.train", "specjet"), ("specjet.serve", "specjet")}


IMPORT, CALL, NEVER = "import", "call", "never"  # when an import runs: as its module is imported,
# when the function holding it is called, or never (``if TYPE_CHECKING:``)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    when: str  # IMPORT, CALL or NEVER
    line: int


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Module name -> file for every .py file of ``root / package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(import node, when it runs) for every import in the module."""
    def visit(nodes, when: str):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, when
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(ast.iter_child_nodes(node), NEVER if when == NEVER else CALL)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from visit(node.body, NEVER)
                yield from visit(node.orelse, when)
            else:
                yield from visit(ast.iter_child_nodes(node), when)

    yield from visit(tree.body, IMPORT)


def import_edges(modules: dict[str, pathlib.Path]) -> list[Edge]:
    """Every import from one module of ``modules`` to another (itself excluded)."""
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, when in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module
                # ``from pkg import sub`` imports the submodule pkg.sub; otherwise a name of pkg.
                targets = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in modules else parent for a in node.names]
            for target in dict.fromkeys(targets):
                if target in modules and target != name:
                    edges.append(Edge(name, target, when, node.lineno))
    return edges


def find_cycles(edges: list[Edge], counted: tuple[str, ...] = (IMPORT,)) -> list[list[str]]:
    """The import cycles among the edges that run ``counted``: each strongly connected set of two or
    more modules (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.when in counted:
            graph.setdefault(e.src, set()).add(e.dst)
            graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(cycles)


def layer_of(module: str) -> str | None:
    """The package of ``RANKS`` that ``module`` belongs to (None: none)."""
    if module == "specjet":
        return "specjet"
    candidates = [p for p in RANKS if p != "specjet" and (module == p or module.startswith(p + "."))]
    return max(candidates, key=len) if candidates else None


def layer_violations(edges: list[Edge]) -> list[str]:
    """Every import against the layering, as 'src -> dst (line n): why'."""
    problems = []
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        where = f"{e.src} -> {e.dst} (line {e.line}{'' if e.when == IMPORT else ', deferred'})"
        if src is None or dst is None:
            unknown = e.src if src is None else e.dst
            problems.append(f"{where}: {unknown} is in no layer of RANKS")
        elif src == dst or RANKS[src] > RANKS[dst]:
            continue
        elif RANKS[src] < RANKS[dst]:
            problems.append(f"{where}: upward, {src} (rank {RANKS[src]}) imports {dst} (rank {RANKS[dst]})")
        elif (src, dst) not in SAME_RANK_ALLOWED:
            problems.append(f"{where}: {src} and {dst} are peers (rank {RANKS[src]})")
    return problems


def describe_cycles(cycles: list[list[str]], edges: list[Edge], counted: tuple[str, ...] = (IMPORT,)) -> str:
    lines = []
    for cycle in cycles:
        members = set(cycle)
        arrows = sorted({f"{e.src} -> {e.dst} (line {e.line}{'' if e.when == IMPORT else ', deferred'})"
                         for e in edges if e.when in counted and e.src in members and e.dst in members})
        lines.append(f"cycle among {', '.join(cycle)}: " + "; ".join(arrows))
    return "\n".join(lines)


# ---------------------------------------------------------------- the repository's graphs
def test_specjet_has_no_import_cycles():
    modules = module_names(REPO_ROOT, "specjet")
    edges = import_edges(modules)
    # The walk must see the real graph, or the checks below would pass on nothing.
    assert len(modules) > 50 and len(edges) > 100, (len(modules), len(edges))
    assert any(e.src == "specjet.models.llama" and e.dst == "specjet.kernels.attention" for e in edges)
    cycles = find_cycles(edges)
    assert not cycles, "import cycles in specjet:\n" + describe_cycles(cycles, edges)


def test_specjet_imports_follow_the_layers():
    modules = module_names(REPO_ROOT, "specjet")
    assert all(layer_of(m) is not None for m in modules), [m for m in modules if layer_of(m) is None]
    problems = layer_violations(import_edges(modules))
    assert not problems, "imports against the layering (RANKS in this file):\n" + "\n".join(problems)


def test_bench_has_no_import_cycles():
    modules = module_names(REPO_ROOT, "bench")
    edges = import_edges(modules)
    assert len(modules) > 5 and edges
    cycles = find_cycles(edges)
    assert not cycles, "import cycles in bench:\n" + describe_cycles(cycles, edges)


def test_no_cycles_even_through_deferred_imports():
    for package in ("specjet", "bench"):
        edges = import_edges(module_names(REPO_ROOT, package))
        cycles = find_cycles(edges, counted=(IMPORT, CALL))
        assert not cycles, (f"import cycles in {package} closed inside functions:\n"
                            + describe_cycles(cycles, edges, counted=(IMPORT, CALL)))


# ---------------------------------------------------------------- the checker on a made-up package
def write_package(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_cycles_and_upward_imports(tmp_path):
    write_package(tmp_path, {
        "specjet/__init__.py": "",
        "specjet/kernels/__init__.py": "",
        # A module-level circle, one side through a relative ``from . import``.
        "specjet/kernels/b.py": "from . import c\n",
        "specjet/kernels/c.py": "import specjet.kernels.b\n",
        # An upward import, deferred into a function: a layering violation, but no cycle with the
        # module-level import back.
        "specjet/kernels/a.py": "def f():\n    from specjet.models import m\n",
        "specjet/models/__init__.py": "",
        "specjet/models/m.py": "from ..kernels import a\nfrom specjet.grammar.g import X\n",
        "specjet/grammar/__init__.py": "",
        "specjet/grammar/g.py": ("from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from specjet.models.m import Y\n"),
        "specjet/demo.py": "import specjet\nfrom specjet.kernels import a\n",
    })
    modules = module_names(tmp_path, "specjet")
    edges = import_edges(modules)
    assert {(e.src, e.dst, e.when) for e in edges} == {
        ("specjet.kernels.b", "specjet.kernels.c", IMPORT),
        ("specjet.kernels.c", "specjet.kernels.b", IMPORT),
        ("specjet.kernels.a", "specjet.models.m", CALL),
        ("specjet.models.m", "specjet.kernels.a", IMPORT),
        ("specjet.models.m", "specjet.grammar.g", IMPORT),
        ("specjet.grammar.g", "specjet.models.m", NEVER),
        ("specjet.demo", "specjet", IMPORT),
        ("specjet.demo", "specjet.kernels.a", IMPORT),
    }
    assert find_cycles(edges) == [["specjet.kernels.b", "specjet.kernels.c"]]
    # Counting deferred imports, a and m close a circle too; the TYPE_CHECKING import never does.
    assert find_cycles(edges, counted=(IMPORT, CALL)) == [["specjet.kernels.a", "specjet.models.m"],
                                                          ["specjet.kernels.b", "specjet.kernels.c"]]
    assert "specjet.kernels.b" in describe_cycles(find_cycles(edges), edges)
    problems = layer_violations(edges)
    assert len(problems) == 3, problems
    assert any(p.startswith("specjet.kernels.a -> specjet.models.m") and "upward" in p for p in problems)
    assert any(p.startswith("specjet.models.m -> specjet.grammar.g") and "peers" in p for p in problems)
    assert any(p.startswith("specjet.grammar.g -> specjet.models.m") and "peers" in p for p in problems)


def test_checker_on_edges_alone():
    edges = [Edge("specjet.engine.x", "specjet.scheduler.y", IMPORT, 1),
             Edge("specjet.scheduler.y", "specjet.engine.x", IMPORT, 2),  # a cycle, and upward
             Edge("specjet.kernels.k", "specjet.spec_v2.s", CALL, 3),  # upward, deferred
             Edge("specjet.spec_v2.s", "specjet.kernels.k", IMPORT, 4),  # fine
             Edge("specjet.newpkg.z", "specjet.kernels.k", IMPORT, 5)]  # in no layer
    assert find_cycles(edges) == [["specjet.engine.x", "specjet.scheduler.y"]]
    problems = layer_violations(edges)
    assert [p.split(":")[0] for p in problems] == [
        "specjet.scheduler.y -> specjet.engine.x (line 2)",
        "specjet.kernels.k -> specjet.spec_v2.s (line 3, deferred)",
        "specjet.newpkg.z -> specjet.kernels.k (line 5)",
    ]
