"""The layers of DESIGN.md hold: nothing imports `rlgraph.cli`, and the subpackages import one
another without a cycle. Read from the source (every import statement, also those inside
functions), so a lazy import cannot hide an upward dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import rlgraph

PACKAGE = Path(rlgraph.__file__).resolve().parent

# What a layer must not import (DESIGN.md's table, the parts of it that hold): the layers above it.
ABOVE = {
    "ir": {"functional", "passes", "plan", "runtime", "backends", "algorithms", "api", "train", "service", "testing"},
    "functional": {"passes", "plan", "runtime", "backends", "algorithms", "api", "train", "service", "testing"},
    "plan": {"passes", "runtime", "backends", "algorithms", "api", "train", "service", "testing"},
    "passes": {"runtime", "backends", "algorithms", "api", "train", "service", "testing"},
    "runtime": {"passes", "algorithms", "api", "train", "service", "testing"},
    "backends": {"passes", "plan", "runtime", "algorithms", "api", "train", "service", "testing"},
    "algorithms": {"passes", "runtime", "backends", "train", "service", "testing"},
    "train": {"service", "testing"},
    # the training service (issue 23) sits beside `train`: calls on the executors, not a run
    "service": {"train", "testing"},
    # environments and tools: beside data and rewards, below the backends that step them between turns
    "agents": {"passes", "plan", "runtime", "backends", "algorithms", "api", "train", "service", "testing"},
    # supervised worker processes: a mechanism under rewards and agents, which hand it their handlers
    # a layout rule the backends build by and the plan's memory model counts by: below both
    "lora_layout": {"ir", "functional", "passes", "plan", "runtime", "backends", "algorithms", "api", "train",
                    "service", "testing", "agents", "rewards", "data", "supervised"},
    # the user's files given by path, loaded in every process: below every layer that unpickles a recipe
    "user_files": {"ir", "functional", "passes", "plan", "runtime", "backends", "algorithms", "api", "train",
                   "service", "testing", "agents", "rewards", "data", "supervised"},
    "supervised": {"functional", "passes", "plan", "runtime", "backends", "algorithms", "api", "train", "service",
                   "testing", "agents", "rewards", "data", "ir"},
}
# Upward edges tolerated for now, each with the reason (none: runtime's `Compiled` / `CONTROLLER`
# moved to plan in issue 19, and the error types to rlgraph.errors below every layer).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every `rlgraph...` module `path` imports, absolute or relative, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from rlgraph import cli`
    return {name for name in found if name == "rlgraph" or name.startswith("rlgraph.")}


def sources() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def subpackage(module: str) -> str | None:
    """`rlgraph.passes.place` -> "passes"; a top-level module (rlgraph.api, rlgraph.cli) is its own part;
    `rlgraph` itself (the public re-exports, `import rlgraph as rg`) is none."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in imports.items():
        source = subpackage(module)
        if source is None:
            continue
        for target in map(subpackage, targets):
            if target is not None and target != source:
                graph.setdefault(source, set()).add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, colours on the stack)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_nothing_imports_the_cli():
    importers = sorted(module for module, targets in sources().items()
                       if "rlgraph.cli" in targets and module not in ("rlgraph.cli", "rlgraph.__main__"))
    assert importers == [], f"{importers} import rlgraph.cli; the CLI only parses and prints (DESIGN.md layers)"


def test_subpackages_import_one_another_without_a_cycle():
    cycle = find_cycle(package_graph(sources()))
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(f"rlgraph.{part}" for part in cycle)


def test_no_layer_imports_one_above_it():
    graph = package_graph(sources())
    upward = {(low, high) for low, banned in ABOVE.items() for high in graph.get(low, ()) if high in banned}
    assert upward - KNOWN_UPWARD == set(), "imports against the layers of DESIGN.md: " + ", ".join(
        f"rlgraph.{low} -> rlgraph.{high}" for low, high in sorted(upward - KNOWN_UPWARD))


def test_the_checks_see_what_they_look_for(tmp_path):
    """The walker finds a lazy, relative and `from rlgraph import cli` import, and the cycle finder a cycle."""
    nested = PACKAGE / "train" / "run.py"
    assert "rlgraph.train.user_code" in imported_modules(nested)
    fake = tmp_path / "mod.py"
    fake.write_text("def f():\n    from rlgraph import cli\n")
    assert "rlgraph.cli" in imported_modules(fake)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert package_graph({"rlgraph.x.m": {"rlgraph.y.n"}, "rlgraph.y.n": {"rlgraph.x"}}) == {"x": {"y"}, "y": {"x"}}
