"""Lower layers never import upper ones: attention/, data/, models/ and train/ know nothing of the
experiment layer (tasks, experiment, commands, cli, forecast tables, bench)."""

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
