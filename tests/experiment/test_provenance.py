"""Provenance records the commit of the code a process imported, even when the checkout moves on before it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import longattn

PACKAGE = Path(longattn.__file__).resolve().parent


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_commit_is_the_one_imported_not_the_one_current_at_write(tmp_path: Path) -> None:
    repo = tmp_path / "checkout"
    shutil.copytree(PACKAGE, repo / "src" / "longattn", ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "imported")
    imported = _git(repo, "rev-parse", "HEAD")
    # the child imports the package, waits until the checkout has a new commit, then writes its provenance
    child = (
        "import sys, json\n"
        "from longattn.experiment.results import provenance\n"
        "print('imported', flush=True)\n"
        "sys.stdin.readline()\n"
        "print(json.dumps(provenance()['git']), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    assert proc.stdout.readline().strip() == "imported"
    (repo / "later.txt").write_text("a later commit\n")
    _git(repo, "add", "later.txt")
    _git(repo, "commit", "-q", "-m", "later")
    assert _git(repo, "rev-parse", "HEAD") != imported
    out, _ = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0
    assert json.loads(out) == {"commit": imported, "dirty": False}
