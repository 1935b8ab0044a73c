"""The package's import graph: no circle, and no import inside a function that only hides one.

Read from the source with `ast`, so a lazy import counts as an edge: a cycle held together by an import inside
a function is still a cycle (it says a function lives in the wrong module)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx

import loracls

PACKAGE = Path(loracls.__file__).parent
LAZY_ALLOWED = {
    "loracls": "`from_pretrained`, `train`, `Classifier` without importing torch for every `import loracls`",
    "loracls.cli": "a command imports only what it runs, after checking its arguments: `--help`, `--version` "
    "and a mistyped path answer in a second, without torch",
    "loracls.cli_data": "the `data` commands, as `cli`: `loracls data --help` answers without torch",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The package's modules an import statement loads (`from loracls.inference import int8` loads
    `loracls.inference.int8`)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.module is None or not node.module.startswith("loracls"):
        return set()
    found = {f"{node.module}.{alias.name}" for alias in node.names} & modules
    return found or ({node.module} & modules)


def import_graph() -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """Every module's imports of the package, and per module those made inside a function."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph, lazy = nx.DiGraph(), {}
    graph.add_nodes_from(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in imported(node, set(files)) - {name}:
                    graph.add_edge(name, target)
                    if node not in top:
                        lazy.setdefault(name, set()).add(target)
    return graph, lazy


def test_the_graph_is_read_from_the_package():
    graph, _ = import_graph()
    assert {"loracls.cli", "loracls.inference.predict", "loracls.inference.export_format"} <= set(graph)
    assert graph.has_edge("loracls.inference.predict", "loracls.inference.export_format")
    assert graph.has_edge(
        "loracls.training.fit", "loracls.training.checkpoints"
    )  # `from loracls.training import ...`


def test_no_import_circle():
    graph, _ = import_graph()
    assert list(nx.simple_cycles(graph)) == []


# What may import what: a layer imports only layers before it (a folder is one layer; docs/contributing.md)
LAYERS = ["errors", "files", "console", "config", "model", "data", "objective", "lora", "environment"]
LAYERS += ["training", "inference", "cli_options", "cli_data", "cli", "__main__", ""]


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_stages_import_only_earlier_stages():
    graph, _ = import_graph()
    assert {layer(module) for module in graph} == set(LAYERS)
    back = [(a, b) for a, b in graph.edges if LAYERS.index(layer(b)) > LAYERS.index(layer(a))]
    assert back == []


def test_imports_inside_functions_only_where_start_up_time_asks_for_them():
    _, lazy = import_graph()
    assert set(lazy) <= set(LAZY_ALLOWED), {name: lazy[name] for name in set(lazy) - set(LAZY_ALLOWED)}


def test_the_light_modules_import_no_transformers_or_peft():
    """`loracls doctor` without --model imports `doctor` and `devices` only: transformers and peft would add
    seconds to its start (`memory`, which needs them, is imported only with --model)."""
    heavy = "{'transformers', 'peft'} & set(sys.modules)"
    code = f"import sys, loracls.environment.devices, loracls.environment.doctor; print(sorted({heavy}))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[]"
