"""verispec's import graph, read from the source with `ast`: no import cycles, and no path from
inference code into the training package.

The graph has an edge A -> B for every `import B` / `from B import x` / `from . import x` in A
that names a module of the package, at module level or inside a function (a lazy import is
still a dependency, and a cycle that only works because one side imports late breaks as soon
as someone hoists the import). `from P import x` points at P.x when that is a module, else at
P. Imports under `if TYPE_CHECKING:` are left out: they never run.

Importing a.b.c also runs a/__init__.py and a/b/__init__.py. Those implicit edges count for
what an import pulls in (`reachable`), not for cycles: a package's __init__ importing its own
submodules, which import each other, is the ordinary package layout, not a cycle.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

# read from the source tree, not imported: the graph must be checkable while the package is broken
PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "verispec"
INFERENCE_ENTRIES = ("verispec.decoder", "verispec.scheduler", "verispec.server.app")
TRAINING_PACKAGE = "verispec.distill"
TRAINING_DOOR = "verispec.cli"  # `verispec distill` runs it: the one module allowed to import it


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at `root` (a folder with __init__.py) by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


class _ImportCollector(ast.NodeVisitor):
    """The dotted targets of every import in one module, `if TYPE_CHECKING:` blocks skipped.
    Each target is (base, names): `import a.b` -> ("a.b", ()), `from a import x, y` -> ("a",
    ("x", "y")), relative imports already resolved against `package`."""

    def __init__(self, package: str) -> None:
        self.package = package  # the package a relative import starts from
        self.targets: list[tuple[str, tuple[str, ...]]] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.targets.extend((alias.name, ()) for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            if node.level - 1 >= len(parts):
                raise ValueError(f"relative import beyond the top of {self.package}")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            if node.module:
                base = f"{base}.{node.module}"
        else:
            base = node.module or ""
        self.targets.append((base, tuple(alias.name for alias in node.names)))


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    """The longest dotted prefix of `name` that is a module of the package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (explicit edges only; see the docstring)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        collector = _ImportCollector(package)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        for base, names in collector.targets:
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] \
                if names else [base]
            for target in targets:
                known = _known_prefix(target, modules)
                if known is not None and known != name:
                    graph[name].add(known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm): its
    modules, sorted. Each of them lies on a cycle with each other one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest cycle from the component's first module back to itself (breadth first,
    inside the component)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{component} is not strongly connected")


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module that importing `start` runs -> one import chain from `start` to it, with
    the implicit edges from a module to the packages above it."""
    def parents(name: str) -> list[str]:
        parts = name.split(".")
        return [p for p in (".".join(parts[:end]) for end in range(1, len(parts))) if p in graph]

    chains = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node]) + parents(node):
            if nxt not in chains:
                chains[nxt] = chains[node] + [nxt]
                frontier.append(nxt)
    return chains


def _describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"{', '.join(component)} (e.g. "
                     f"{' -> '.join(_cycle_through(component, graph))})"
                     for component in found)


# -- verispec itself ----------------------------------------------------------------------------


def test_the_package_has_no_import_cycles():
    graph = import_graph(PACKAGE_ROOT)
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s):\n{_describe(found, graph)}"


def test_no_cycle_runs_through_the_draft_folder_distill_or_the_bench():
    """The cycles that went with the draft folder living in `distill` (decoder -> distill ->
    decoder) and with the bench's shared helpers (bench.throughput <-> bench.harness)."""
    owned = ("verispec.distill", "verispec.bench", "verispec.drafters.folder",
             "verispec.drafters.load", "verispec.vocab")
    graph = import_graph(PACKAGE_ROOT)
    found = [component for component in cycles(graph)
             if any(m == o or m.startswith(o + ".") for m in component for o in owned)]
    assert not found, _describe(found, graph)


def _in_training(module: str) -> bool:
    return module == TRAINING_PACKAGE or module.startswith(TRAINING_PACKAGE + ".")


def training_imports(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import chains from a module outside `distill` (but the CLI) into `distill`."""
    checked = [m for m in graph if not _in_training(m) and m != TRAINING_DOOR]
    assert set(INFERENCE_ENTRIES) <= set(checked)
    return [chain for entry in checked
            for module, chain in reachable(graph, entry).items() if _in_training(module)]


def test_inference_never_imports_the_training_package():
    """Not the decoder, the scheduler or the server, nor anything else outside `distill` but
    the CLI: the draft folder's format lives in `verispec.drafters.folder`."""
    graph = import_graph(PACKAGE_ROOT)
    assert TRAINING_PACKAGE in graph
    bad = training_imports(graph)
    assert not bad, "imports of the training package:\n" + "\n".join(
        " -> ".join(chain) for chain in bad)


def test_a_lazy_import_of_the_training_package_would_be_caught():
    """The negative control: one function-level import of distill's data module in the folder
    reader shows up from the decoder, the scheduler and the server."""
    graph = import_graph(PACKAGE_ROOT)
    graph["verispec.drafters.folder"] = graph["verispec.drafters.folder"] | {
        "verispec.distill.data"}
    starts = {chain[0] for chain in training_imports(graph)}
    assert set(INFERENCE_ENTRIES) <= starts


def test_the_graph_sees_the_imports_it_must():
    """Known edges of the real package, so a builder that silently found nothing would fail:
    a module-level import, a function-level one and a package __init__'s."""
    graph = import_graph(PACKAGE_ROOT)
    assert "verispec.drafters.load" in graph["verispec.decoder"]
    assert "verispec.distill" in graph["verispec.cli"]  # inside run_distill
    assert "verispec.drafters.feature" in graph["verispec.drafters"]
    assert "verispec.drafters.folder" in reachable(graph, "verispec.decoder")


# -- the checker on a package built to fail -----------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


def test_a_cycle_through_relative_and_function_level_imports_is_found(tmp_path):
    """pkg.a -> pkg.sub.b (relative, module level) -> pkg.c (`from .. import c`, inside a
    function) -> pkg.a (absolute): one cycle. pkg.d's import of pkg.a under TYPE_CHECKING, and
    pkg.a's of pkg.d, make none; nor does an __init__ importing its own submodules."""
    root = _write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import thing\n",
        "pkg/a.py": "from .sub.b import helper\nfrom pkg import d\nthing = 1\n",
        "pkg/sub/__init__.py": "from . import b\n",
        "pkg/sub/b.py": "def helper():\n    from .. import c\n    return c\n",
        "pkg/c.py": "import pkg.a\nimport os\n",
        "pkg/d.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.a import thing
            else:
                import json
            """,
    })
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.sub.b", "pkg.d"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert _cycle_through(["pkg.a", "pkg.c", "pkg.sub.b"], graph) == [
        "pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert "pkg.sub" in reachable(graph, "pkg.a")  # importing pkg.sub.b runs pkg/sub/__init__


def test_two_separate_cycles_are_both_listed(tmp_path):
    root = _write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x.py": "from pkg import y\n",
        "pkg/y.py": "from pkg.x import name\n",
        "pkg/p.py": "def late():\n    import pkg.q\n",
        "pkg/q.py": "from . import p\n",
        "pkg/free.py": "from pkg import x\n",
    })
    assert cycles(import_graph(root)) == [["pkg.p", "pkg.q"], ["pkg.x", "pkg.y"]]
