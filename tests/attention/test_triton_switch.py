"""The switch that decides where the Triton kernels run (longattn.attention._triton)."""

import contextlib
import warnings

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


def test_on_device_makes_the_tensors_cuda_device_current(monkeypatch):
    """Triton launches on the current CUDA device: on_device enters torch.cuda.device of the given one (a tensor
    on cuda:1 launches on cuda:1), and records it for captured launches; on other devices it enters nothing."""
    from longattn.attention._triton import launch_device, on_device

    entered = []

    @contextlib.contextmanager
    def fake_cuda_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)
    with on_device(torch.device("cuda", 1)):
        assert launch_device() == torch.device("cuda", 1) and entered == [torch.device("cuda", 1)]
    with on_device(torch.device("cpu")):
        assert launch_device() == torch.device("cpu") and len(entered) == 1
    assert launch_device() is None


# One module per GPU-path function that takes kernels (every launcher of every kernel module is reached), with
# options that make its kernels run at 37 tokens (bigbird: 97, below which it attends densely).
SHARED_MEMORY_CASES = [
    ("local", dict(window_size=8)),
    ("bigbird", dict(block_size=16, random_blocks=1)),
    ("longformer", dict(attention_window=8, global_positions=(0, 30))),
    ("transformer_ls", dict(window_size=4, rank=6)),
    ("linear", dict(causal=True)),
    ("reformer", dict(bucket_size=8)),
    ("informer", {}),
    ("skein", {}),
    ("skeleton", dict(max_len=64, s1=12)),
]
# The kernels launched only in a backward pass (informer's and skein's kernels have none: no gradient flows there).
BACKWARD_KERNELS = {"_delta_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel", "_bwd_extra_kernel", "_core_bwd_kernel",
                    "_chunk_backward", "_lsh_chunk_backward", "_segment_mean_bwd", "_stem_input_bwd",
                    "_backward_sums_kernel", "_backward_input_kernel"}


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
@pytest.mark.parametrize("name, options, too_big", [
    (name, options, too_big) for name, options in SHARED_MEMORY_CASES
    for too_big in ("every kernel", "backward kernels")[:1 if name in ("informer", "skein") else 2]],
    ids=lambda value: value if isinstance(value, str) else "")
def test_a_kernel_over_the_devices_shared_memory_takes_the_pytorch_gpu_path_said_once(
        monkeypatch, fresh_warnings, name, options, too_big):
    """The launch-time check, with a fake limit (the interpreter has none): a kernel that needs more shared
    memory than the device has is never launched; the mechanism's output and gradients are its PyTorch GPU
    path's, and one warning per kernel that does not fit says so, once."""
    from longattn import attention
    from longattn.attention import _triton, force_path

    torch.manual_seed(0)
    layer = attention.build(name, dim=16, heads=2, **options)
    x = torch.randn(2, 97 if name == "bigbird" else 37, 16, requires_grad=True)

    def run():
        torch.manual_seed(1)
        out = layer(x)
        return out, torch.autograd.grad(out.square().sum(), [x, *layer.parameters()], allow_unused=True)

    with force_path("gpu"), use_triton(False):
        want, want_grads = run()

    def needed(kernel, grid, args, kwargs):
        return 10**6 if too_big == "every kernel" or kernel.__name__ in BACKWARD_KERNELS else 1

    monkeypatch.setattr(_triton, "checks_shared_memory", lambda device: device is not None)
    monkeypatch.setattr(_triton, "shared_memory_needed", needed)
    monkeypatch.setattr(_triton, "shared_memory_limit", lambda device: 1000)
    monkeypatch.setattr(_triton, "_FITS", set())
    monkeypatch.setattr(_triton, "_BACKWARDS_CHECKED", set())
    with interpret_triton(), force_path("gpu"), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got, got_grads = run()
        run()
    messages = [str(w.message) for w in said if "shared memory" in str(w.message)]
    assert messages and len(messages) == len(set(messages))
    assert all("1,000,000 B of shared memory per block, cpu has 1,000 B" in m for m in messages)
    torch.testing.assert_close(got, want)
    # the Smoother's steps fall back one by one: with only its backward kernels too big its forward ran the kernels,
    # whose float32 sums round apart from the PyTorch steps' in the last bits
    tolerance = dict(rtol=1e-4, atol=1e-4) if name == "skeleton" and too_big == "backward kernels" else {}
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tolerance)
