"""What only a GPU can check of the block-sparse GPU path (local, bigbird, longformer, transformer_ls):
the Triton kernels compiled for a real device against the float64 references under bf16, fp16 and
float32, against the PyTorch GPU path, causal and padded; peak memory of one forward+backward against
softmax attention's module at 16k tokens; deterministic gradients; dropout. Skipped without CUDA (the
same code runs on CPU in test_blocksparse_gpu_path.py and, in Triton's interpreter,
test_blocksparse_triton.py)."""

import pytest
import torch

from longattn import attention
from longattn.attention._triton import triton_installed, use_triton
from longattn.testing import scattered_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [
    ("local", dict()), ("local", dict(causal=True)), ("bigbird", dict()),
    ("longformer", dict(global_positions=(0, 1000))), ("longformer", dict(causal=True)),
    ("transformer_ls", dict()), ("transformer_ls", dict(causal=True, chunk_size=64, window_size=128)),
]
# RMS(error) / RMS(float64 reference), output and input gradient
RATIO = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def ratio(a, b):
    return ((a.double().cpu() - b).square().mean().sqrt() / b.square().mean().sqrt()).item()


def build(name, options):
    torch.manual_seed(0)
    return attention.build(name, dim=256, heads=4, **options).cuda()


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name,options", CASES)
def test_kernels_against_float64(name, options, dtype):
    layer = build(name, options)
    reference = attention.build(name, dim=256, heads=4, **options).double()
    reference.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    n = 2000
    x = torch.randn(2, n, 256, device="cuda", requires_grad=True)
    mask = scattered_mask(2, n).cuda()
    upstream = torch.randn(2, n, 256, device="cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = layer(x, mask)
    out.backward(upstream.to(out.dtype))
    x64 = x.detach().double().cpu().requires_grad_()
    ref = reference(x64, mask.cpu())
    ref.backward(upstream.double().cpu())
    assert out.dtype == dtype
    assert ratio(out, ref) < RATIO[dtype], ratio(out, ref)
    assert ratio(x.grad, x64.grad) < RATIO[dtype], ratio(x.grad, x64.grad)


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
@pytest.mark.parametrize("name,options", CASES)
def test_kernels_equal_the_pytorch_gpu_path(name, options):
    layer = build(name, options)
    x = torch.randn(2, 1500, 256, device="cuda", requires_grad=True)
    mask = scattered_mask(2, 1500).cuda()
    results = []
    for kernels in (True, False):
        x.grad = None
        with use_triton(kernels):
            out = layer(x, mask)
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone()))
    (out_k, grad_k), (out_p, grad_p) = results
    torch.testing.assert_close(out_k, out_p, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_k, grad_p, atol=2e-4, rtol=1e-3)


def peak_mib(name, n, batch):
    torch.manual_seed(0)
    layer = attention.build(name, dim=512, heads=8).cuda()
    x = torch.randn(batch, n, 512, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # warm-up: kernels compiled, tables built
        layer(x).float().sum().backward()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
@pytest.mark.parametrize("name", ["local", "bigbird", "longformer", "transformer_ls"])
def test_peak_memory_at_16k_is_at_most_softmax_attentions(name):
    """The benchmark's shape at 16k: batch 4, dim 512, 8 heads, bf16 autocast, forward+backward."""
    softmax = peak_mib("softmax", 16384, 4)
    mine = peak_mib(name, 16384, 4)
    assert mine <= softmax, (name, mine, softmax)


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_gradients_are_deterministic_without_extra_keys():
    layer = build("local", {})
    x = torch.randn(2, 3000, 256, device="cuda", requires_grad=True)
    grads = []
    for _ in range(2):
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).float().square().sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("name", ["local", "longformer", "transformer_ls"])
def test_dropout(name, kernels):
    if kernels and not triton_installed():
        pytest.skip("triton is not installed")
    torch.manual_seed(0)
    layer = attention.build(name, dim=256, heads=4, dropout=0.5).cuda()
    x = torch.randn(1, 700, 256, device="cuda", requires_grad=True)
    with use_triton(kernels):
        expected = layer.eval()(x).detach()
        layer.train()
        draws = torch.stack([layer(x) for _ in range(64)])
        draws[0].square().sum().backward()
    assert not torch.equal(draws[0], draws[1]) and x.grad.isfinite().all()
    error = (draws.mean(0) - expected).abs().mean() / expected.abs().mean()
    assert error < 0.2, error


@pytest.mark.parametrize("kernels", [True, False])
def test_rows_that_see_no_key_have_finite_gradients(kernels):
    if kernels and not triton_installed():
        pytest.skip("triton is not installed")
    layer = build("longformer", dict(attention_window=8))
    x = torch.randn(2, 300, 256, device="cuda", requires_grad=True)
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[0, :100] = False  # a padded run longer than the window, the global token padded too
    with use_triton(kernels):
        out = layer(x, mask)
    out.square().sum().backward()
    assert out.isfinite().all() and x.grad.isfinite().all()
    assert all(p.grad is None or p.grad.isfinite().all() for p in layer.parameters())
