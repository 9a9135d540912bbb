"""The package as people depend on it: requirements, version, typing marker, licence, optional extras."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import longattn

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("yaml", "tqdm", "matplotlib", "PIL", "sklearn", "scipy", "pandas", "transformers", "tokenizers",
            "safetensors")


def pyproject():
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_library_requires_only_torch_and_numpy_with_a_lower_bound_on_torch():
    from packaging.requirements import Requirement
    from packaging.version import Version

    requirements = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    assert sorted(r.name for r in requirements) == ["numpy", "torch"]
    (torch_req,) = [r for r in requirements if r.name == "torch"]
    operators = {spec.operator for spec in torch_req.specifier}
    assert operators == {">="}, "torch gets a lower bound only; the exact CPU pin belongs in the install command"
    (bound,) = [Version(spec.version) for spec in torch_req.specifier]
    # the bound is checked by this very run: the suite runs on a torch that satisfies it
    assert Version(torch.__version__).release[:2] >= bound.release[:2]
    assert torch_req.specifier.contains(Version(torch.__version__).public, prereleases=True)


def test_install_command_pins_the_cpu_torch_in_readme_and_ci_alike():
    cpu, command = re.findall(r"python3 -m pip install .*", (ROOT / "README.md").read_text())[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert cpu == 'python3 -m pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu'
    assert '"torch==2.13.0"' in command
    for line in (cpu, command.split(" && ")[0]):
        assert line in ci.replace(" -q ", " ")
    extras = pyproject()["project"]["optional-dependencies"]
    assert {"experiments", "hf", "peers", "dev"} <= set(extras)
    for module, extra in (("pyyaml", "experiments"), ("matplotlib", "experiments"), ("transformers", "hf")):
        assert any(r.startswith(module) for r in extras[extra])


def test_one_version_source_and_the_cli_prints_it():
    assert pyproject()["project"]["dynamic"] == ["version"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "longattn.__version__"}
    out = subprocess.run([sys.executable, "-m", "longattn.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}, check=True)
    assert out.stdout.strip() == f"longattn {longattn.__version__}"
    assert f"## {longattn.__version__}" in (ROOT / "CHANGELOG.md").read_text()


BLOCKER = f"""
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
sys.meta_path.insert(0, Blocker())
"""


def test_the_library_imports_and_runs_without_the_optional_packages():
    # every module outside the experiment layer (commands/, forecast/, the CLI) imports with only torch
    # and numpy; longattn.hf imports transformers only when it is used
    script = BLOCKER + """
import importlib, pkgutil, torch, longattn
failed = []
for info in pkgutil.walk_packages(longattn.__path__, "longattn."):
    if info.name.startswith(("longattn.commands", "longattn.forecast", "longattn.cli")):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as err:
        failed.append(f"{info.name}: {err}")
assert not failed, failed
from longattn import attention
layer = attention.build("skeleton", dim=16, heads=2, max_len=32, s1=4, s2=4)
assert layer(torch.randn(1, 32, 16)).shape == (1, 32, 16)
import longattn.hf
try:
    longattn.hf.register("softmax")
except ImportError as err:
    assert "longattn[hf]" in str(err)
else:
    raise AssertionError("transformers should be blocked")
from longattn.cli import main
assert main(["--version"]) == 0
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_command_whose_extra_is_missing_says_which_extra_to_install():
    script = BLOCKER + """
from longattn.cli import main
raise SystemExit(main(["train", "--task", "listops", "--preset", "demo", "--out", "unused"]))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src")},
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "pip install 'longattn[experiments]'" in out.stderr


def test_built_wheel_metadata(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("longattn-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {longattn.__version__}" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch>=2.11"], requires
    core = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(line.split()[1].split(">")[0] for line in core) == ["numpy", "torch"]
    assert "License-Expression: MIT" in metadata
    assert "longattn/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    assert any(n.startswith("longattn/configs/lra/") for n in names)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m pytest.*$", readme, flags=re.MULTILINE)
    assert len(commands) == 1, commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[0] in ci_lines
