"""The package's layout, read from its own imports (docs/architecture.md).

Every ``import`` counts, those inside functions too (a lazy import is still
an arrow).  The rules:

* no import cycle between modules;
* ``errors``, ``units``, ``catalog`` and ``hostops`` sit at the bottom:
  they import nothing of lorasync but each other;
* ``plan/`` is pure: no torch, nothing of ``comm``, ``train``, the network
  packages (``netdiag``, ``overlay``, ``emulate``), ``launch``, ``bench``
  or the integrations;
* ``comm`` knows nothing of models, data, runs or networks: no ``train``,
  ``monitor``, network package, ``launch``, ``bench`` or integration.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lorasync

SRC = Path(lorasync.__file__).resolve().parent
NETWORK = ("lorasync.netdiag", "lorasync.overlay", "lorasync.emulate")
INTEGRATIONS = ("lorasync.hf", "lorasync.integrations")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolve(module: str, package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """Every module ``name`` names in an import (lorasync's own, and the
    top-level name of others: ``torch``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.name if a.name.startswith("lorasync") else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, package, node)
            if not target.startswith("lorasync"):
                out.add(target.split(".")[0])
                continue
            for a in node.names:   # ``from pkg import mod`` names the module
                sub = f"{target}.{a.name}"
                out.add(sub if sub in MODULES else target)
    return out


GRAPH = {m: {i for i in imports_of(m) if i in MODULES and i != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    # a check that reads nothing passes everything: make sure it sees known arrows
    assert "lorasync.errors" in GRAPH["lorasync.units"]
    assert "lorasync.plan.costmodel" in GRAPH["lorasync.plan.policy"]
    assert "torch" in imports_of("lorasync.comm.base")


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other in a circle: " + "; ".join(
        " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", ["lorasync.errors", "lorasync.units", "lorasync.catalog",
                                  "lorasync.hostops"])
def test_the_ground_floor_imports_nothing_above_it(name):
    ground = {"lorasync.errors", "lorasync.units", "lorasync.catalog", "lorasync.hostops"}
    above = sorted(i for i in GRAPH[name] if i not in ground)
    assert not above, f"{name} imports {above}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _under(m, ["lorasync.plan"])))
def test_plan_is_pure(name):
    banned = ("lorasync.comm", "lorasync.train", "lorasync.launch", "lorasync.bench",
              "lorasync.monitor", *NETWORK, *INTEGRATIONS)
    bad = sorted(i for i in imports_of(name) if i == "torch" or _under(i, banned))
    assert not bad, f"{name} (plan is pure: measurements in, ranked strategies out) imports {bad}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _under(m, ["lorasync.comm"])))
def test_comm_knows_no_models_runs_or_networks(name):
    banned = ("lorasync.train", "lorasync.monitor", "lorasync.launch", "lorasync.bench",
              *NETWORK, *INTEGRATIONS)
    bad = sorted(i for i in GRAPH[name] if _under(i, banned))
    assert not bad, f"{name} imports {bad}"
