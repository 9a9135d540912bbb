"""The per-device path switch (uses_gpu_path / force_path), the output dtype rule and the op counter."""

import pytest
import torch

from longattn import attention
from longattn.attention import AttentionError, force_path, output_dtype, uses_gpu_path
from longattn.testing import DispatchCounter


def test_device_picks_the_path_unless_forced():
    x = torch.zeros(2)
    assert not uses_gpu_path(x)
    with force_path("gpu"):
        assert uses_gpu_path(x)
        with force_path("cpu"):
            assert not uses_gpu_path(x)
        assert uses_gpu_path(x)
    assert not uses_gpu_path(x)
    with pytest.raises(AttentionError, match="force_path takes one of"):
        with force_path("tpu"):
            pass


def test_output_dtype_is_the_autocast_dtype_inside_autocast():
    x = torch.zeros(2)
    assert output_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_dtype(x) == torch.bfloat16
    assert output_dtype(x.double()) == torch.float64


def test_dispatch_counter_counts_forward_and_backward_on_meta():
    layer = attention.build("softmax", dim=16, heads=2).to("meta")
    x = torch.randn(2, 64, 16, device="meta", requires_grad=True)
    with DispatchCounter() as forward_only:
        layer(x)
    with DispatchCounter() as both:
        layer(x).sum().backward()
    assert 0 < forward_only.total < both.total
    assert both.counts["aten.addmm"] + both.counts["aten.mm"] >= 4  # the projections, forward and backward
