"""The Triton kernels compiled for real GPUs (sm_90, sm_80) on this CPU: one configuration of every kernel the
registered mechanisms launch, bf16 at head dim 64 (longattn.bench.aot; the whole matrix is ``longattn bench
compile``). The tests' own kernels are the interpreter's (TRITON_INTERPRET=1, tests/conftest.py), which cannot be
compiled, so the compile runs in a child process without it (from a file: triton reads a kernel's source), with a
triton cache of its own. About 40 s on two busy cores (a compile of each of the ~25 kernels for each target)."""

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

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longattn.attention import _triton
from longattn.bench.aot import AotConfig, capture_forms, compile_launch, run_aot, ttir_hazards


# the TTIR check itself, on two kernels with and without each hazard
@triton.jit
def rows_times_stride(x_ptr, stride, WIDE: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    if WIDE:
        rows = rows.to(tl.int64)
    tl.store(x_ptr + rows * stride, 1.0)


@triton.jit
def add_at_every_step(x_ptr, steps, BARRIER: tl.constexpr, BM: tl.constexpr):
    offsets = tl.arange(0, BM)
    for _ in range(steps):
        if BARRIER:
            tl.debug_barrier()
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) + 1.0)


def hazards(kernel, switch, on):
    signature = {"x_ptr": "*fp32", kernel.arg_names[1]: "i32", switch: "constexpr", "BM": "constexpr"}
    source = ASTSource(kernel, signature, {(2,): on, (3,): 64})
    return ttir_hazards(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"])


report = run_aot(AotConfig.suite(archs=[90, 80]), log=lambda line: None)
report["probes"] = {"int32": hazards(rows_times_stride, "WIDE", False),
                    "int64": hazards(rows_times_stride, "WIDE", True),
                    "no_barrier": hazards(add_at_every_step, "BARRIER", False),
                    "barrier": hazards(add_at_every_step, "BARRIER", True)}
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
    script = tmp_path_factory.mktemp("aot") / "aot_check.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
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


def test_every_kernel_computes_its_offsets_in_64_bits_and_rereads_after_a_barrier(aot_report):
    flagged = [(r["module"], r["kernel"], r["arch"], r["int32_address_products"], r["unsynchronised_rereads"])
               for r in aot_report["rows"] if r["int32_address_products"] or r["unsynchronised_rereads"]]
    assert not flagged
    assert aot_report["hazards"] == 0


def test_the_ttir_check_finds_a_32_bit_offset_product_and_a_reread_without_barrier(aot_report):
    probes = aot_report["probes"]
    assert probes["int32"]["int32_address_products"] == ["aot_check.py:19"]  # rows * stride, rows in 32 bits
    assert probes["int64"] == probes["barrier"] == {"int32_address_products": [], "unsynchronised_rereads": []}
    assert probes["no_barrier"]["unsynchronised_rereads"] == ["aot_check.py:28"]  # the load after the store


def test_every_launcher_launches_under_its_tensors_device(aot_report):
    assert aot_report["outside_device_guard"] == []
