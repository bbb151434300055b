"""No import cycles among kvyard's modules: each module sits on a floor above
everything it imports.

Read from the source with `ast`, not by importing, so every import counts:
module level, inside functions (a deferred import only hides a cycle from the
interpreter, not from the design) and under `if TYPE_CHECKING:` (a type that
needs the other module is a dependency on it all the same: `TYPE_CHECKING_COUNTS`
says so, in one place). An import of a
package's submodule counts as an import of that submodule, not of the package's
`__init__`; a name taken from a package that is a submodule (`from pkg import
mod`) counts as that submodule.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# setup.py's folder → namespace map (operator/ is kvyard.operator).
ROOTS = {"kvyard": "kvyard", "kvyard.epp": "epp", "kvyard.workers": "workers",
         "kvyard.kvstore": "kvstore", "kvyard.operator": "operator"}
TYPE_CHECKING_COUNTS = True


@dataclass(slots=True, frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # path:line of the import


def modules(repo: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Module name → (file, is a package's __init__)."""
    found: dict[str, tuple[Path, bool]] = {}
    for name, folder in ROOTS.items():
        root = repo / folder
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            found[".".join([name, *parts])] = (path, is_pkg)
    return found


def _known(name: str, mods: dict) -> str | None:
    """The longest prefix of `name` that is one of ours (`a.b.func` → `a.b`)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def _base(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute module a relative `from ...target import` names."""
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    pkg = pkg[:len(pkg) - (level - 1)]
    return ".".join(pkg + ([target] if target else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                or isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def edges(mods: dict[str, tuple[Path, bool]], repo: Path = REPO,
          type_checking: bool = TYPE_CHECKING_COUNTS) -> list[Edge]:
    out: list[Edge] = []
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(mod, is_pkg, node.level, node.module) if node.level else node.module
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            where = f"{path.relative_to(repo)}:{getattr(node, 'lineno', 0)}"
            for t in targets:
                dst = _known(t, mods)
                if dst is not None and dst != mod:
                    out.append(Edge(mod, dst, where))
    return out


def cycles(graph_edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of two or more modules."""
    graph: dict[str, list[Edge]] = {}
    for e in graph_edges:
        graph.setdefault(e.src, []).append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, []):
            if e.dst not in index:
                connect(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(comp, graph) for comp in comps]


def _one_cycle(comp: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in graph.get(v, []):
                if e.dst not in comp:
                    continue
                if e.dst == start:
                    return paths[v] + [e]
                if e.dst not in paths:
                    paths[e.dst] = paths[v] + [e]
                    nxt.append(e.dst)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def describe(cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].src, *(e.dst for e in cycle)])
    return names + "\n" + "\n".join(f"    {e.src} imports {e.dst} at {e.where}" for e in cycle)


def test_no_import_cycles() -> None:
    found = cycles(edges(modules()))
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(describe(c) for c in found)


def test_finds_a_function_level_cycle(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by a deferred, relative import is found and named."""
    pkg = tmp_path / "kvyard" / "stack"
    pkg.mkdir(parents=True)
    (tmp_path / "kvyard" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvyard.stack import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import thing\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import kvyard.stack.a\n")
    mods = modules(tmp_path)
    found = cycles(edges(mods, tmp_path))
    assert [describe(c).splitlines()[0] for c in found] == \
        ["kvyard.stack.a -> kvyard.stack.b -> kvyard.stack.a"]
    assert Edge("kvyard.stack.c", "kvyard.stack.a", "kvyard/stack/c.py:3") in edges(mods, tmp_path)
    assert not [e for e in edges(mods, tmp_path, type_checking=False) if e.src == "kvyard.stack.c"]
