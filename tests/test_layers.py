"""The layers of DESIGN.md hold: nothing imports `rlgraph.cli`, the subpackages import one another
without a cycle, and so do the modules (but the cycles `ALLOWED_CYCLES` names). Read from the source
(every import statement, also those inside functions), so a lazy import cannot hide an upward
dependency or a cycle."""

from __future__ import annotations

import ast
import functools
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


def import_statements(path: Path) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """Each import statement of `path`, at any depth: `(module, None)` for `import module`, `(base,
    names)` for `from base import names` (relative bases resolved). Parsed once per file version:
    every test here reads the whole package."""
    stat = path.stat()
    return _import_statements(str(path), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _import_statements(file: str, mtime_ns: int, size: int) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    path, found = Path(file), []
    for node in ast.walk(ast.parse(path.read_text(), file)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, tuple(alias.name for alias in node.names)))
    return tuple(found)


def imported_modules(path: Path) -> set[str]:
    """Every `rlgraph...` module `path` imports, absolute or relative, at any depth of the file."""
    found = set()
    for base, names in import_statements(path):
        found.add(base)
        found.update(f"{base}.{name}" for name in names or ())  # `from rlgraph import cli`
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


# Import cycles between modules tolerated, each with its reason (issue 35 untied every other one).
# `rlgraph` itself (the public `__init__`, `import rlgraph as rg`) re-exports every layer, so it is
# left out of the module graph, as `package_graph` leaves it out.
ALLOWED_CYCLES = {
    "rlgraph.ir": "inherent: a loss closure is traced inside `rg.update`, so the primitives call the tracer, "
                  "which records primitives",
}


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports, as Python resolves them: `from a.b import c` is
    an import of the module `a.b.c` where there is one (a submodule, not the package's `__init__`),
    else of `a.b`; `import a.b.c` of `a.b.c`."""
    found = set()
    for base, names in import_statements(path):
        if names is None:
            found.add(base)
        else:
            found.update(f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names)
    return found & modules


def module_graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the rlgraph modules it imports (a package's `__init__` under the package's name)."""
    modules = set(paths) - {"rlgraph"}
    return {module: module_imports(path, modules) - {module} for module, path in paths.items() if module in modules}


def module_paths() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) per group of modules that import one another (a strongly connected
    component of more than one module), found within that group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while (member := stack.pop()) != node:
                on_stack.discard(member)
                group.add(member)
            on_stack.discard(node)
            group.add(node)
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [find_cycle({m: graph[m] & group for m in group}) for group in groups]


def test_nothing_imports_the_cli():
    importers = sorted(module for module, targets in sources().items()
                       if "rlgraph.cli" in targets and module not in ("rlgraph.cli", "rlgraph.__main__"))
    assert importers == [], f"{importers} import rlgraph.cli; the CLI only parses and prints (DESIGN.md layers)"


def test_subpackages_import_one_another_without_a_cycle():
    cycle = find_cycle(package_graph(sources()))
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(f"rlgraph.{part}" for part in cycle)


def test_modules_import_one_another_without_a_cycle():
    """Within a package too: a cycle means two modules hold one concept between them (or a re-export
    points back), and which loads first depends on who imports them. The allowed cycles are named."""
    cycles = [cycle for cycle in module_cycles(module_graph(module_paths()))
              if not any(all(_inside(module, package) for module in cycle) for package in ALLOWED_CYCLES)]
    assert cycles == [], "import cycles between modules: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


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
    modules = {"rlgraph.a", "rlgraph.a.m", "rlgraph.a.n"}
    fake.write_text("from rlgraph.a import m, name\nimport rlgraph.a.n\ndef f():\n    from rlgraph import cli\n")
    assert module_imports(fake, modules) == {"rlgraph.a.m", "rlgraph.a", "rlgraph.a.n"}
    assert module_cycles({"m": {"n"}, "n": {"k", "m"}, "k": set()}) == [["m", "n", "m"]]
    assert module_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
