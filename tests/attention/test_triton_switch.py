"""The switch that decides where the Triton kernels run (longattn.attention._triton)."""

import pytest
import torch

from longattn.attention._triton import interpret_triton, triton_installed, triton_runs_on, use_triton


def test_kernels_never_run_on_cpu_tensors_outside_the_interpreter():
    assert not triton_runs_on(torch.zeros(1))


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_interpreter_runs_kernels_on_cpu_unless_switched_off():
    x = torch.zeros(1)
    with interpret_triton():
        assert triton_runs_on(x)
        with use_triton(False):
            assert not triton_runs_on(x)
        assert not triton_runs_on(x.to("meta"))
