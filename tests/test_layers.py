"""The layers import in one direction (docs/architecture.md): pipeshard.core <- pipeshard.formats <- exporter/,
partitioner/, runtime/ (never each other) <- profiles/ (may use runtime/) <- pipeshard/ (the CLI, API, server,
batch and bench: used by nothing). Every import counts, function-local ones included; no module cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
from conftest import parse_python

REPO = Path(__file__).resolve().parents[1]
# folder -> the import name of its layer
FOLDERS = {
    "pipeshard/core": "core",
    "pipeshard/formats": "formats",
    "exporter": "exporter",
    "partitioner": "partitioner",
    "runtime": "runtime",
    "profiles": "profiles",
    "pipeshard": "top",
}
ALLOWED = {
    "core": {"core"},
    "formats": {"core", "formats"},
    "exporter": {"core", "formats", "exporter"},
    "partitioner": {"core", "formats", "partitioner"},
    "runtime": {"core", "formats", "runtime"},
    "profiles": {"core", "formats", "runtime", "profiles"},
    "top": {"core", "formats", "exporter", "partitioner", "runtime", "profiles", "top"},
}


PACKAGES = {"pipeshard", *(f"pipeshard.{name}" for name in ALLOWED if name != "top")}


def module_name(path: Path, root: Path) -> str:
    """The import name of a source file: exporter/fuse.py -> pipeshard.exporter.fuse."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] != "pipeshard":
        parts.insert(0, "pipeshard")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("core", "formats", "exporter", "partitioner", "runtime", "profiles"):
        return parts[1]
    return "top"


def imports_of(source: str, module: str, modules: set[str]) -> set[str]:
    """Every pipeshard module `source` imports, anywhere in the file: `from pipeshard.x import y` imports the
    module pipeshard.x.y when there is one, else pipeshard.x."""
    found = set()
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    for node in ast.walk(parse_python(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "pipeshard"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] == "pipeshard":
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found


def import_graph(root: Path, extra: dict[str, str] | None = None) -> nx.DiGraph:
    """Modules of the package under `root` (plus `extra`: module name -> source) and their imports."""
    sources = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            sources[module_name(path, root)] = path.read_text()
    sources.update(extra or {})
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for module, source in sources.items():
        for target in imports_of(source, module, set(sources)):
            if target in sources and target != module:
                graph.add_edge(module, target)
    return graph


def wrong_imports(graph: nx.DiGraph) -> list[str]:
    """Each import against the layers' direction, and each cycle, as a line naming the modules."""
    problems = [
        f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)})"
        for source, target in graph.edges
        if layer_of(target) not in ALLOWED[layer_of(source)]
    ]
    problems += [f"cycle: {' -> '.join(cycle)}" for cycle in nx.simple_cycles(graph)]
    return problems


def test_every_import_goes_down_the_layers_and_no_module_cycles():
    assert wrong_imports(import_graph(REPO)) == []


def test_a_planted_wrong_import_or_cycle_is_found():
    planted = {
        "pipeshard.runtime.planted": "def f():\n    from pipeshard.partitioner.planner import Planner\n",
        "pipeshard.exporter.planted": "import pipeshard.runtime.step\n",
        "pipeshard.formats.planted": "from pipeshard import api\n",
        "pipeshard.runtime.cycle_a": "from pipeshard.runtime import cycle_b\n",
        "pipeshard.runtime.cycle_b": "from pipeshard.runtime.cycle_a import x\n",
    }
    problems = wrong_imports(import_graph(REPO, planted))
    assert any("runtime.planted (runtime) imports pipeshard.partitioner.planner" in p for p in problems)
    assert any("exporter.planted (exporter) imports pipeshard.runtime.step" in p for p in problems)
    assert any("formats.planted (formats) imports pipeshard.api" in p for p in problems)
    assert any(p.startswith("cycle:") and "cycle_a" in p for p in problems)


def test_the_package_root_imports_nothing_at_import_time():
    """`import pipeshard.core.errors` must not pull in the API (the stages import the bottom layer through it)."""
    tree = parse_python((REPO / "pipeshard" / "__init__.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert [ast.unparse(n) for n in top_level] == [
        "from pipeshard.core.version import __version__ as __version__"
    ]
