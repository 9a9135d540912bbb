"""Lower layers never import upper ones: attention/, data/, models/ and train/ know nothing of the
experiment layer (tasks, experiment, commands, cli, forecast tables, bench); and no circle of imports joins
two packages."""

import ast
from pathlib import Path

import pytest

import longattn

PACKAGE = Path(longattn.__file__).parent
LOWER = ("attention", "data", "models", "train")
UPPER = ("longattn.tasks", "longattn.experiment", "longattn.commands", "longattn.cli", "longattn.forecast",
         "longattn.bench", "longattn.hf")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_do_not_import_the_experiment_layer(layer):
    offenders = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == upper or name.startswith(upper + ".") for upper in UPPER):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert offenders == []


def test_the_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from longattn.experiment.run import run\nimport longattn.commands.train\n")
    assert {"longattn.experiment.run", "longattn.commands.train"} <= imported_modules(bad)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the longattn modules it imports anywhere in its file (at the top or inside a function); ``from
    longattn.x import y`` counts as importing ``longattn.x.y`` when that is a module, else ``longattn.x``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                               for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_import_circles_stay_inside_one_package():
    """A package may import itself lazily (a registry that loads its members, a kernel file beside its
    mechanism), but no circle of imports joins two packages: each layer can be read, tested and replaced on
    its own."""
    crossing = [sorted(c) for c in import_circles(import_graph()) if len({m.split(".")[1] for m in c}) > 1]
    assert crossing == []


def test_the_circle_check_can_fail():
    graph = {"longattn.a.x": {"longattn.b.y"}, "longattn.b.y": {"longattn.a.x"}, "longattn.a.z": {"longattn.a.x"}}
    assert import_circles(graph) == [{"longattn.a.x", "longattn.b.y"}]
