"""The package imports in one direction: every import (function-local ones included) goes to the importing
module's own layer or a lower one, in the layer order docs/architecture.md writes down; and no import circle
is longer than two files.

Imports under `if TYPE_CHECKING:` are left out: they name types for annotations and never run.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeserve"


def module_files() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_imports(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = module_files()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` names the module; `from mod import name` the module it lives in
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                if target.split(".")[0] == "moeserve" and (dep := owner(target)) and dep != mod:
                    graph[mod].add(dep)
    return graph


def layer_order() -> list[list[str]]:
    """The fenced block under '## Layers' in docs/architecture.md, top layer first: each line names the
    top-level modules / packages of one layer before an optional description."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Layers\n.*?```\n(.*?)```", text, re.S | re.M)
    assert block, "docs/architecture.md needs a '## Layers' section with the order in a fenced block"
    layers = []
    for line in block.group(1).splitlines():
        names = line.split("  ")[0].split()
        if names:
            layers.append(names)
    return layers


def top_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moeserve"


def test_every_module_has_a_layer():
    placed = [n for layer in layer_order() for n in layer]
    assert len(placed) == len(set(placed)), f"named in two layers: {sorted({n for n in placed if placed.count(n) > 1})}"
    tops = {top_name(m) for m in module_files()}
    assert tops <= set(placed), (f"not in docs/architecture.md's layer order: {sorted(tops - set(placed))}; "
                                 "add each to the layer it belongs to")
    assert set(placed) <= tops, f"layers name what does not exist: {sorted(set(placed) - tops)}"


def test_no_upward_import():
    level = {name: i for i, layer in enumerate(layer_order()) for name in layer}  # 0: the top layer
    upward = [f"{mod} -> {dep}" for mod, deps in sorted(import_graph().items()) for dep in sorted(deps)
              if level[top_name(dep)] < level[top_name(mod)]]
    assert not upward, "imports that go up the layer order of docs/architecture.md:\n  " + "\n  ".join(upward)


def test_no_import_circle_longer_than_two_files():
    graph = import_graph()
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            if len(component) > 2:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles of more than two files: {circles}"


def test_the_walk_sees_lazy_imports():
    """The walk is real: a function-local import shows as an edge (engine_core imports kv_transfer inside
    a method), a TYPE_CHECKING one does not (the MTP proposer's scheduler types)."""
    graph = import_graph()
    assert "moeserve.engine.kv_transfer" in graph["moeserve.engine.engine_core"]
    assert "moeserve.engine.scheduler" not in graph["moeserve.speculative.proposer"]


def test_every_module_is_described():
    """docs/architecture.md's module map names every file of the package (a new module gets its line)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(p.name)}", text))
    assert not unnamed, f"modules docs/architecture.md does not describe: {unnamed}"
