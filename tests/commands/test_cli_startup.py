"""A command line that answers at once: ``longattn --help``, ``--version`` and every verb's ``--help`` (the list of
its subcommands for a verb that has them) import neither torch nor any heavy package (counted in a fresh
interpreter, not timed); the command modules import them when a command runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import longattn
from longattn.commands import VERB_HELP

# What a fresh interpreter imports to print the help: the standard library and a few longattn modules (about 45
# today); torch alone brings hundreds.
MAX_MODULES = 120
HEAVY = ("torch", "numpy", "matplotlib", "yaml", "tqdm", "transformers", "triton", "fla", "scipy", "pandas")

_CHILD = """
import json, sys
before = set(sys.modules)
from longattn.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(set(sys.modules) - before)), file=sys.stderr)
"""


def _imported(*argv: str) -> list[str]:
    source = str(Path(longattn.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    env.pop("LONGATTN_PLUGINS", None)  # a plugin may import what it likes
    done = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    return json.loads(done.stderr.strip().splitlines()[-1])


# The verbs whose --help still loads torch, and why: each lists the entries of a registry that is filled by
# importing modules that import torch (a second, static list of those names would be one more place to keep). Every
# other verb, a new one included, must answer its --help without torch.
HELP_LISTS_A_REGISTRY = {
    "train": "--task and --attention list the registered tasks and mechanisms",
    "pretrain": "--preset lists the shipped presets of the registered mlm task",
}


def test_the_verbs_whose_help_lists_a_registry_exist():
    assert set(HELP_LISTS_A_REGISTRY) <= set(VERB_HELP)


@pytest.mark.parametrize("argv", [["--help"], ["--version"],
                                  *([verb, "--help"] for verb in VERB_HELP if verb not in HELP_LISTS_A_REGISTRY)])
def test_help_and_version_import_no_torch(argv):
    modules = _imported(*argv)
    heavy = sorted({name.partition(".")[0] for name in modules} & set(HEAVY))
    assert not heavy, f"`longattn {' '.join(argv)}` imports {heavy}"
    assert len(modules) <= MAX_MODULES, f"`longattn {' '.join(argv)}` imports {len(modules)} modules"
    assert "longattn.cli" in modules  # the child did run the command line

