"""Helpers for tests and the footprint benchmark: measure what a computation materialises."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class LargestTensorRecorder(TorchDispatchMode):
    """Records the largest tensor (by element count) produced by any ATen op run inside it.

    Backward ops triggered by ``.backward()`` inside the ``with`` block are dispatched through the
    mode too, so one recorder covers forward and backward::

        with LargestTensorRecorder() as rec:
            layer(x).sum().backward()
        assert rec.max_numel < n * n
    """

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.max_shape: tuple[int, ...] = ()
        self.max_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel = t.numel()
                self.max_shape = tuple(t.shape)
                self.max_op = str(func)
        return out


class DispatchCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it, forward and backward: on a GPU each is (at least) one
    kernel launch, so a count that grows with the sequence length or the batch is a Python loop that
    launches per block, chunk or row. Runs on any device, ``meta`` included (shapes only, no data,
    so N = 64k costs nothing)::

        with force_path("gpu"), DispatchCounter() as ops:
            layer(x).sum().backward()
        ops.total, ops.counts.most_common(5)
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# CUDA autocast's op lists (torch.amp docs, "CUDA Op-Specific Behavior") where they differ from the CPU's:
# CUDA runs these in float32 (CPU autocast leaves them in the input's dtype) ...
_CUDA_FLOAT32_OPS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
    "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal",
    "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
})
# ... these in the autocast dtype (the CPU list has the GEMMs but not the matrix-vector products) ...
_CUDA_LOWER_OPS = frozenset({"addmv", "addr", "mv", "chain_matmul", "multi_dot", "einsum"})
# ... these in the widest input type ...
_CUDA_PROMOTE_OPS = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add",
                               "tensordot"})
# ... and cuFFT has no bfloat16 (CPU autocast runs the FFTs in float32, CUDA autocast leaves them alone).
_FFT_PREFIXES = ("fft", "rfft", "irfft", "hfft", "ihfft", "ifft", "stft", "istft")
_HALF = (torch.float16, torch.bfloat16)


class CudaAutocastOnCPU(TorchFunctionMode):
    """CUDA autocast's dtype rules on CPU tensors, inside ``torch.autocast("cpu", ...)``.

    CPU and CUDA autocast cast different ops: on CUDA, ``softmax``, ``sum``, ``exp``, ``pow``,
    ``cumsum``, ``layer_norm``, ``logsumexp`` ... return float32 for half inputs, where CPU autocast
    leaves them in bfloat16; a mechanism that is fine under CPU autocast can then mix dtypes on CUDA
    (``index_add_(): self (BFloat16) and source (Float)``). Inside this mode those ops get CUDA's casts
    (the float32 list, the matrix-vector products in the autocast dtype, the promote list), and an FFT
    of a half tensor raises as cuFFT would, so the CPU tests see the dtypes a CUDA run sees::

        with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCPU(), force_path("gpu"):
            layer(x).float().sum().backward()

    An emulation of the documented op lists at the Python level (``torch.softmax``, ``Tensor.sum``,
    ``F.layer_norm`` ...), not of the dispatcher: ops called from C++ keep the CPU rules.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and kwargs.get("out") is None:  # out= variants are not autocast
            name = getattr(func, "__name__", "")
            if name in _CUDA_FLOAT32_OPS and kwargs.get("dtype") is None:
                args, kwargs = _cast_half((args, kwargs), torch.float32)
            elif name in _CUDA_LOWER_OPS:
                args, kwargs = _cast_half((args, kwargs), torch.get_autocast_dtype("cpu"), every_float=True)
            elif name in _CUDA_PROMOTE_OPS:
                floats = [t.dtype for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                          and t.is_floating_point()]
                if floats:
                    widest = max(floats, key=lambda d: torch.finfo(d).bits)
                    args, kwargs = _cast_half((args, kwargs), widest, every_float=True)
            elif name.startswith(_FFT_PREFIXES):
                if any(isinstance(t, torch.Tensor) and t.dtype in _HALF for t in tree_flatten((args, kwargs))[0]):
                    raise RuntimeError(f"{name} of a half-precision tensor: cuFFT has no bfloat16 kernels and CUDA "
                                       "autocast leaves FFTs in the input's dtype; cast to float32 first")
        return func(*args, **kwargs)


def _cast_half(tree: Any, dtype: torch.dtype, every_float: bool = False) -> Any:
    """Floating tensors of ``tree`` cast to ``dtype``: the half ones, or every floating one."""
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and (every_float or t.dtype in _HALF):
            return t.to(dtype)
        return t
    return tree_map(cast, tree)


class LocalFileServer:
    """Serves in-memory files over HTTP on 127.0.0.1 for the download tests (no other network use).

    ``files`` maps a file name to its bytes; any URL path ending in that name serves it. Range requests
    are honoured (206), and every request's Range header is recorded in ``ranges``::

        with LocalFileServer({"a.zip": data}) as server:
            download_file(server.url + "/a.zip", dest)
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.files = files
        self.ranges: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's API)
                name = self.path.rsplit("/", 1)[-1]
                server.ranges.append(self.headers.get("Range"))
                if name not in server.files:
                    self.send_error(404)
                    return
                body, status = server.files[name], 200
                header = self.headers.get("Range")
                if header:
                    start = int(header.split("=")[1].split("-")[0])
                    body, status = body[start:], 206
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/mirror"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "LocalFileServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def scattered_mask(batch: int, length: int, seed: int = 5, pad_fraction: float = 0.3) -> torch.Tensor:
    """A key-padding mask (True = real token) with padding scattered anywhere, first token always real."""
    mask = torch.rand(batch, length, generator=torch.Generator().manual_seed(seed)) > pad_fraction
    mask[:, 0] = True
    return mask


def random_qkv(batch: int, heads: int, length: int, head_dim: int, seed: int = 0, dtype: torch.dtype = torch.float64,
               scale: float = 1.0) -> list[torch.Tensor]:
    """Query, key and value [B, H, N, Dh] from one seeded generator, leaves that require gradients."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, heads, length, head_dim, generator=g, dtype=dtype) * scale).requires_grad_()
            for _ in range(3)]


def assert_forward_backward_close(out: torch.Tensor, ref: torch.Tensor, inputs: list[torch.Tensor], **tolerances: Any) -> None:
    """A fast path equals its reference: outputs, and the gradients of ``inputs`` for one random upstream
    gradient (drawn from the global RNG, so seed it for reproducible tests)."""
    torch.testing.assert_close(out, ref, **tolerances)
    upstream = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, upstream), torch.autograd.grad(ref, inputs, upstream)):
        torch.testing.assert_close(got, want, **tolerances)
