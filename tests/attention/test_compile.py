"""torch.compile trains every module-form mechanism for a step (issue 56): new mechanisms are picked up automatically.

Each registered mechanism, bidirectional and (where it declares ``causal``) causal, takes one training step at tiny
shapes (forward with scattered and suffix padding, a loss, backward) under ``torch.compile`` with each backend its
``capabilities.compile_backends`` names, and must give eager's output, input gradient and parameter gradients, in
float32 with torch.testing's float32 tolerances (rtol 1.3e-6, atol 1e-5; ``aot_eager`` runs the same aten ops as
eager, so the differences are rounding at most). Graph breaks are allowed (``fullgraph=False``: data-dependent
selections, ``.item()``, the library's context variables); a counting backend proves that dynamo captured graphs
instead of falling back to eager. A mechanism that declares no backend must refuse to be compiled with an
``AttentionError``.

``inductor`` cases run with ``LONGATTN_TEST_INDUCTOR=1`` (skipped otherwise, with that reason): on a CPU inductor
compiles C++ for every graph of both passes, 3 to 90 s of wall time a case (about 26 min for the 55 on one core of
the shared two), against about 5 CPU-seconds a case for ``aot_eager``. They run with
``torch._inductor.config.fallback_random`` (eager's random numbers for the stochastic mechanisms: inductor's own
generator draws others) and with a tolerance for fused float32 sums (rtol 1e-4, atol 1e-5: inductor reorders
reductions; the differences seen are about 1e-6 of each tensor's largest entry). docs/reliability.md has the
table of declared backends, which this file also checks (and writes:
``python tests/attention/test_compile.py --write docs/reliability.md``).

Cost: dynamo and AOT autograd trace each case from scratch (``torch._dynamo.reset()`` before each: the layers share
``AttentionBase.forward``, whose compiled versions would otherwise fill dynamo's cache and fall back to eager):
about 5 CPU-seconds a case (skeleton's 13 graphs the most), 4 min 43 s of CPU for the 55 cases on one core
(measured with these steps outside pytest; 37 minutes of wall time at a load of 10 to 13 on the shared two cores).
Much of it goes to the frames after the base class's graph breaks (its ContextVar reads), traced for every case.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # run as the docs' writer: the tests' helpers on the path, as pytest puts them
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from longattn import attention
from longattn.attention import AttentionError
from reliability import CLEAR_ERROR, COMPILE, CORRECT_RESULT, bad_input

ROOT = Path(__file__).resolve().parents[2]
NAMES = attention.available()
DIM, HEADS, N = 16, 2, 19
# Options that put a mechanism on its main path at N = 19 (bigbird's default 64-token blocks fall back to dense
# softmax below 2 + window + random = 8 blocks).
MAIN_PATH = {"bigbird": {"block_size": 2}}
INDUCTOR = os.environ.get("LONGATTN_TEST_INDUCTOR") == "1"
SKIP_INDUCTOR = pytest.mark.skipif(not INDUCTOR, reason="inductor compiles C++ on a CPU (3-90 s a case): run with "
                                   "LONGATTN_TEST_INDUCTOR=1")
# Tolerances per backend: aot_eager runs eager's aten ops (torch.testing's float32 defaults); inductor fuses them
TOLERANCES = {"aot_eager": {}, "inductor": {"rtol": 1e-4, "atol": 1e-5}}
CASES = [pytest.param(name, causal, backend, id=f"{name}-{'causal' if causal else 'bidirectional'}-{backend}",
                      # the opt-in inductor cases are not counted in docs/reliability.md's table (the suite skips them)
                      marks=[SKIP_INDUCTOR] if backend == "inductor" else [bad_input(COMPILE, CORRECT_RESULT)])
         for name in NAMES for causal in (False, True) if not causal or attention.capabilities(name).causal
         for backend in attention.capabilities(name).compile_backends]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def training_step(call, layer, x, mask):
    """Output, input gradient and parameter gradients of one step through ``call`` (``layer`` or its compiled form)."""
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)  # the same draws for stochastic mechanisms
    out = call(x, mask)
    out.square().sum().backward()
    return out.detach(), x.grad, {key: p.grad for key, p in layer.named_parameters() if p.grad is not None}


def inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, N, DIM, generator=g)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, 3] = False
    mask[1, 15:] = False
    return x, mask


@pytest.mark.parametrize("name,causal,backend", CASES)
def test_a_training_step_under_torch_compile_equals_eager(name, causal, backend):
    torch.manual_seed(0)
    layer = attention.build(name, dim=DIM, heads=HEADS, max_len=N, causal=causal, **MAIN_PATH.get(name, {})).train()
    x, mask = inputs()
    expected_out, expected_xgrad, expected_grads = training_step(layer, layer, x, mask)
    counter = CompileCounterWithBackend(backend)
    with _inductor_draws_eagers_random_numbers(backend):
        out, xgrad, grads = training_step(torch.compile(layer, backend=counter), layer, x, mask)
    assert counter.frame_count >= 1, "dynamo captured no graph: the step ran eagerly"
    tolerance = TOLERANCES[backend]
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(xgrad, expected_xgrad, **tolerance)
    assert grads.keys() == expected_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], expected_grads[key], msg=key, **tolerance)


@contextmanager
def _inductor_draws_eagers_random_numbers(backend):
    if backend != "inductor":
        yield
        return
    from torch._inductor import config

    with config.patch(fallback_random=True):
        yield


@bad_input(COMPILE, CLEAR_ERROR)
def test_a_mechanism_that_declares_no_backend_refuses_torch_compile():
    softmax = attention.get_spec("softmax").module_cls

    class Uncompilable(softmax):
        capabilities = replace(softmax.capabilities, compile_backends=())

    layer = Uncompilable(dim=DIM, heads=HEADS)
    x, mask = inputs()
    eager = layer(x, mask)  # eager is untouched
    with pytest.raises(AttentionError, match="'softmax' does not run under torch.compile .*compile_backends"):
        torch.compile(layer, backend="aot_eager")(x, mask)
    # the documented way out: the layer runs eagerly inside a compiled model
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.compiler.disable(layer))
    torch.testing.assert_close(torch.compile(model, backend="aot_eager")(x), model(x))
    torch.testing.assert_close(layer(x, mask), eager)


# ----------------------------------------------------------------------------- the table in docs/reliability.md

TABLE_BEGIN = "<!-- torch.compile backends: written by tests/attention/test_compile.py from capabilities.compile_backends; do not edit by hand -->"
TABLE_END = "<!-- end of torch.compile backends -->"
DOC = ROOT / "docs" / "reliability.md"


def compile_table() -> str:
    rows = ["| mechanism | forms trained for a step | backends |", "|---|---|---|"]
    for name in NAMES:
        caps = attention.capabilities(name)
        forms = "bidirectional, causal" if caps.causal else "bidirectional"
        backends = ", ".join(f"`{b}`" for b in caps.compile_backends) or "none: `AttentionError` under torch.compile"
        rows.append(f"| `{name}` | {forms} | {backends} |")
    return "\n".join([TABLE_BEGIN, *rows, TABLE_END])


def table_in(text: str) -> str | None:
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return None
    return text[text.index(TABLE_BEGIN):text.index(TABLE_END) + len(TABLE_END)]


def test_the_docs_list_the_declared_backends():
    assert table_in(DOC.read_text(encoding="utf-8")) == compile_table(), (
        "docs/reliability.md does not list the declared torch.compile backends; update it with "
        "python tests/attention/test_compile.py --write docs/reliability.md")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the table of torch.compile backends into a markdown file")
    parser.add_argument("--write", type=Path, required=True, help="the markdown file (docs/reliability.md)")
    path = parser.parse_args().write
    text = path.read_text(encoding="utf-8")
    old = table_in(text)
    if old is None:
        raise SystemExit(f"{path} has no {TABLE_BEGIN!r} ... {TABLE_END!r} block to replace")
    path.write_text(text.replace(old, compile_table()), encoding="utf-8")
    print(compile_table())
