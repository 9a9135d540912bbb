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


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The once-per-process warnings and the import check forgotten, for the test and after it."""
    from longattn.attention import _triton

    monkeypatch.setattr(_triton, "_SAID", set())
    _triton.triton_importable.cache_clear()
    yield
    _triton.triton_importable.cache_clear()


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_a_broken_triton_falls_back_to_the_pytorch_gpu_path_and_says_so_once(monkeypatch, fresh_warnings):
    import sys

    from longattn import attention
    from longattn.attention import force_path

    torch.manual_seed(0)
    layer = attention.build("local", dim=16, heads=2, window_size=8)
    x = torch.randn(2, 37, 16)
    with force_path("gpu"), use_triton(False):
        want = layer(x)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with interpret_triton(), force_path("gpu"), pytest.warns(RuntimeWarning, match="fails to import") as said:
        assert not triton_runs_on(x)
        got = layer(x)
        layer(x)
    assert len([w for w in said if "fails to import" in str(w.message)]) == 1
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("hip, capability, reason", [(None, (7, 5), "need sm_80"), ("6.2", (9, 0), "ROCm")])
def test_a_device_that_cannot_take_the_kernels_takes_the_pytorch_gpu_path_said_once(
        monkeypatch, fresh_warnings, hip, capability, reason):
    from longattn.attention._triton import device_takes_kernels

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    cuda = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match=reason) as said:
        assert not device_takes_kernels(cuda)
        assert not device_takes_kernels(cuda)
    assert len(said) == 1


def test_an_ampere_or_newer_nvidia_gpu_takes_the_kernels(monkeypatch, fresh_warnings):
    from longattn.attention._triton import device_takes_kernels

    monkeypatch.setattr(torch.version, "hip", None)
    for capability in [(8, 0), (9, 0), (10, 0)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert device_takes_kernels(torch.device("cuda", 0))


def test_float32_on_a_gpu_takes_the_pytorch_path_of_the_blocksparse_and_scan_kernels():
    from longattn.attention._triton import float32_takes_pytorch_path

    assert float32_takes_pytorch_path(torch.empty(1, device="meta"))  # meta: as captured for a GPU
    assert not float32_takes_pytorch_path(torch.empty(1, device="meta", dtype=torch.bfloat16))
    assert not float32_takes_pytorch_path(torch.empty(1))  # the interpreter keeps float32 for the tests
