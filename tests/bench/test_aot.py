"""The Triton kernels compiled for real GPUs (sm_90, sm_80) on this CPU: one configuration of every kernel the
registered mechanisms launch, bf16 at head dim 64 (longattn.bench.aot; the whole matrix is ``longattn bench
compile``). The tests' own kernels are the interpreter's (TRITON_INTERPRET=1, tests/conftest.py), which cannot be
compiled, so the compile runs in a child process without it, with a triton cache of its own. About 40 s on two
busy cores (a compile of each of the ~25 kernels for each target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import longattn

pytest.importorskip("triton")

_SCRIPT = """
import json, sys
from longattn.attention import _triton
from longattn.bench.aot import AotConfig, capture_forms, compile_launch, run_aot

report = run_aot(AotConfig.suite(archs=[90, 80]), log=lambda line: None)
# the check of the limit itself: the same kernel against a block limit below what it needs
(form, launch), = capture_forms("informer", AotConfig.suite().forms(causal=False), heads=4, batch=2)[0][:1]
_triton.SHARED_MEMORY_PER_BLOCK[90] = 16
report["tiny_limit"] = compile_launch(launch, 90)
json.dump(report, sys.stdout)
"""


@pytest.fixture(scope="module")
def aot_report(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("triton-cache")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(longattn.__file__).parents[1]), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_kernel_compiles_for_sm90_and_sm80_within_shared_memory(aot_report):
    rows = aot_report["rows"]
    assert {r["arch"] for r in rows} == {80, 90}
    kernels = {(r["module"], r["kernel"]) for r in rows}
    # every kernel module of the library is reached by some registered mechanism's module form
    assert {module for module, _ in kernels} >= {"_blocksparse_triton", "_informer_triton", "_linear_scan_triton",
                                                 "_reformer_triton", "_skein_triton", "_skeleton_triton",
                                                 "_smoother_triton"}
    assert len(rows) == 2 * len(kernels)
    bad = [(r["module"], r["kernel"], r["arch"], r["status"], r.get("error"), r.get("shared")) for r in rows
           if r["status"] != "ok"]
    assert not bad
    assert all(0 <= r["shared"] <= r["shared_limit"] and r["registers"] > 0 for r in rows)


def test_a_kernel_over_the_shared_memory_limit_fails(aot_report):
    tiny = aot_report["tiny_limit"]
    assert tiny["status"] == "over shared memory" and tiny["shared"] > tiny["shared_limit"] == 16
