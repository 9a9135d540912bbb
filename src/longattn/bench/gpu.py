"""``longattn bench gpu``: everything a GPU must show, measured in one process in a few minutes.

Four parts, each with its share of the time budget (a row that would run past its share, or out of
memory, is skipped and says so):

* **accuracy**: every mechanism's module form (with scattered padding) against the same module in
  float64, under float32, bfloat16 and float16 autocast, forward and input gradient; pass rule
  RMS(error) / RMS(reference) below :data:`RATIOS` (flash-linear-attention's rule), output in the
  autocast dtype. float32 is measured twice: as the library runs it (its convolutions in IEEE float32,
  see :func:`longattn.attention.exact_float32`) and inside :func:`longattn.attention.allow_tf32`;
* **speed**: forward + backward of the module forms under bfloat16 autocast at each length with the same
  number of tokens per call (batch = tokens / N), CUDA-event medians after warm-up, peak memory, against
  the softmax module (projections + SDPA's flash kernel) in the same process; each row with its floor:
  its FLOPs (counted on the PyTorch GPU path) at the measured bfloat16 GEMM rate or its unavoidable bytes
  at the measured copy bandwidth, whichever is larger, and the ratio of its time to that floor.
  Mechanisms with Triton kernels run with them on and off;
* **train**: steps of an LRA task (ListOps, generated) through the library's training loop in bfloat16;
* **hf**: the Hugging Face bridge: a BERT converted to each mechanism, forward and backward under
  bfloat16 autocast (softmax's conversion also checked against the original model in float32).

On a CPU (``--device cpu``, with ``--smoke`` for tiny sizes) the same code runs with the GPU path forced
and CUDA's autocast rules emulated, so that a typo cannot fail the device run.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from longattn import attention
from longattn.attention import allow_tf32, force_path, output_dtype
from longattn.attention._triton import SHARED_MEMORY_PER_BLOCK, triton_installed, use_triton
from longattn.bench.speed import count_flops, layer_traffic_bytes, peak_memory
from longattn.testing import CudaAutocastOnCPU, DispatchCounter, scattered_mask

__all__ = ["GRADIENT_BOUNDS", "GpuCheckConfig", "RATIOS", "SAME_CHOICES_IN_EVERY_DTYPE", "compare_with_float64",
           "run_gpu_check"]

SOFTMAX = "softmax"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# RMS(error) / RMS(reference) bounds per dtype: (output, input gradient). float32 is IEEE float32 against
# float64; the half types' bounds are a few units of their rounding (2^-8, 2^-11) after a chain of GEMMs
# and normalisations.
RATIOS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 1e-2)}
# Mechanisms whose input gradient under autocast is further from float64 than RATIOS allow for a reason of the
# mechanism, not of its GPU path (rounding only the inputs moves the exact gradient as far, or the CPU path
# under the same autocast is as far), with the gradient bound they get:
# * PoNet's max-poolings (eqs. 3-4) send the gradient to the largest entry, and rounding the branch
#   projections to 8 (bfloat16) or 11 (float16) bits reorders near-tied entries;
# * cosFormer's ReLU features (eq. 6): rounding flips the sign of near-zero pre-activations, and with them
#   the ReLU's derivative (0 or 1). Inherent: rounding only x and the weights to bfloat16 / float16 and
#   computing the rest in float64 moves the gradient by 1.7e-2 / 1.0e-2 (ELU features: 2.3e-3 / 3.2e-4);
#   the GPU path under autocast measures 2.4e-2 / 1.6e-2 (N = 257);
# * Performer in bfloat16: the exponent w.x of its positive random features (Lemma 1) is a GEMM output
#   rounded to 8 bits, and exp turns that absolute error into a relative error of the features; its CPU
#   path under the same autocast has the same gradient error (2.0e-2, N = 1023, dim 128, 4 heads; the GPU
#   path 1.8e-2 to 2.2e-2), where rounding only x and the weights gives 4e-3;
# * FLASH in float16: its gradients pass through the 1/N of the linear term and the 1/c of the chunks'
#   squared-ReLU attention (eqs. 6-7) and fall below float16's normal range without a loss scale (1.0e-2
#   at N = 1023, in the CPU path under the same autocast too; 1.9e-3 with the upstream gradient scaled by
#   2^10 as a GradScaler does, which float16 training needs anyway);
# * skeleton: the Smoother's position-wise BatchNorm backward subtracts per-position means of the
#   half-precision gradient it receives, which cancels where a position's conv outputs vary little; its
#   module-by-module CPU path under the same autocast has the same error (4.7e-2 in bfloat16), and the
#   float16 error depends on the weights (4.3e-4 to 2.8e-2 over four seeds; test_skeleton_gpu.py's bounds).
GRADIENT_BOUNDS = {"ponet": {torch.bfloat16: 0.1, torch.float16: 0.1},
                   "cosformer": {torch.bfloat16: 5e-2, torch.float16: 3e-2},
                   "performer": {torch.bfloat16: 4e-2},
                   "flash": {torch.float16: 3e-2},
                   "skeleton": {torch.bfloat16: 8e-2, torch.float16: 2.5e-2}}
# Options where the defaults would test a corner: Nystromformer's 256 landmarks would give each token of a
# short test sequence a landmark of its own; 32 make segments of several tokens.
ACCURACY_OPTIONS = {"nystrom": {"num_landmarks": 32}}


def _pin_fsat_edges(layer: torch.nn.Module, length: int) -> None:
    """FSAT's edges are floor(I_bar) (eq. 9): rounding I_bar across an integer changes the graph, which no
    dtype comparison survives. The index predictor is pinned (W_I = 0, biases exact in both half types)
    with I_bar away from integers, so every dtype builds the same graph and the comparison measures the
    arithmetic."""
    candidates = [b / 16 for b in range(-48, 49)]
    good = [b for b in candidates
            if 0.25 < (torch.sigmoid(torch.tensor(b, dtype=torch.float64)).item() * length) % 1 < 0.75]
    with torch.no_grad():
        layer.to_index.weight.zero_()
        layer.to_index.bias.copy_(torch.tensor(good[: layer.to_index.bias.numel()]))


def _reformer_buckets_irrelevant(layer: torch.nn.Module, length: int) -> None:
    """Reformer's buckets are the signs of random rotations of the shared queries-keys (section 2): rounding
    flips those near a boundary, which changes who attends to whom. One hashing round of two chunks that
    attend across buckets lets every query see every key whatever its bucket, so the comparison measures the
    arithmetic of the GPU path (hashing, sorting, chunked attention and its gradient scattered back); that the
    buckets themselves are right is tested against the reference in test_reformer.py."""
    layer.n_hashes, layer.bucket_size, layer.attend_across_buckets = 1, -(-length // 2), True


def _informer_every_query_active(layer: torch.nn.Module, length: int) -> None:
    """Informer's active queries are the top u of the sampled measure M_bar (eq. 4), whose near-ties rounding
    reorders. With c = N, u = m: every real query is active whatever the ranking, so the comparison measures
    the arithmetic of the GPU path (the sampled measure, the gathers of the active queries, their attention
    and the scatter back); which queries the measure picks is tested against the reference in
    test_informer.py."""
    layer.factor = float(length)


def _dsa_indexer_ties(layer: torch.nn.Module, length: int) -> None:
    """DSA's selection is the top-k of the indexer's scores (eq. 1), whose near-ties rounding reorders. With the
    indexer's queries zero every score is exactly 0, so each query selects its first top_k
    visible keys (ties go to the earlier key) in every dtype, and the comparison measures the arithmetic of the
    GPU path (indexer, sort, gathers, attention and its gradient scattered back) on a sparse selection; which
    keys the indexer picks is tested against the reference and fla's naive DSA in test_dsa.py."""
    with torch.no_grad():
        layer.indexer.to_query.weight.zero_()
        layer.indexer.to_query.bias.zero_()
    layer.top_k = max(1, length // 4)


# Per mechanism: what makes its discrete choices the same in every dtype.
SAME_CHOICES_IN_EVERY_DTYPE: dict[str, Callable[[torch.nn.Module, int], None]] = {
    "fsat": _pin_fsat_edges, "informer": _informer_every_query_active, "reformer": _reformer_buckets_irrelevant,
    "dsa": _dsa_indexer_ties}


def rms_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-300)).item()


# One measured run of :func:`compare_runs_with_float64`: (dtype, the library's convolutions in TF32 or not).
Run = tuple[torch.dtype, bool]


def compare_runs_with_float64(name: str, runs: dict[str, Run], *, device: str | torch.device = "cpu", length: int = 257,
                              batch: int = 2, dim: int = 32, heads: int = 2) -> dict[str, dict[str, Any]]:
    """The module form of ``name`` in each run's dtype (autocast for the half types; with ``tf32`` inside
    :func:`allow_tf32`) against the same module in float64, on one batch with scattered padding. Per run:
    the output dtype and whether it is the one expected, RMS ratios of the output and of the input gradient
    (one random upstream gradient), whether padded outputs are zero and parameter gradients finite; a run
    that raises gives {"status": "error", "error": ...}.

    The float64 reference (computed once) runs the CPU path, tested against each mechanism's plain reference
    in its tests, on ``device``, with the same weights and random draws. The measured runs take the GPU
    path: on CUDA by their device, on a CPU forced, with CUDA's autocast rules emulated."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = attention.build(name, dim=dim, heads=heads, max_len=length, **ACCURACY_OPTIONS.get(name, {})).eval()
    if name in SAME_CHOICES_IN_EVERY_DTYPE:
        SAME_CHOICES_IN_EVERY_DTYPE[name](layer, length)
    reference_layer = copy.deepcopy(layer).double().to(device)
    layer = layer.to(device)
    x = torch.randn(batch, length, dim, generator=generator).to(device)
    mask = scattered_mask(batch, length).to(device)
    x64 = x.double().requires_grad_()
    torch.manual_seed(1)  # the same draws for stochastic mechanisms
    with force_path("cpu"):
        want = reference_layer(x64, mask)
    upstream = torch.randn(want.shape, generator=generator, dtype=torch.float64).to(device)
    want.backward(upstream)

    on_cpu = device.type == "cpu"
    results: dict[str, dict[str, Any]] = {}
    for label, (dtype, tf32) in runs.items():
        layer.zero_grad(set_to_none=True)
        x_run = x.clone().requires_grad_()
        torch.manual_seed(1)
        try:
            with (force_path("gpu") if on_cpu else contextlib.nullcontext()), \
                    (CudaAutocastOnCPU() if on_cpu else contextlib.nullcontext()), \
                    (allow_tf32() if tf32 else contextlib.nullcontext()):
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    got = layer(x_run, mask)
                    expected_dtype = output_dtype(x_run)
                got.backward(upstream.to(got.dtype))  # outside autocast, as a training loop runs it
        except Exception as exc:  # noqa: BLE001 (one run's failure is its result)
            results[label] = {"status": "error", "error": _error(exc)}
            continue
        results[label] = {
            "dtype": str(got.dtype).removeprefix("torch."),
            "dtype_ok": got.dtype == expected_dtype,
            "out_ratio": rms_ratio(got, want),
            "grad_ratio": rms_ratio(x_run.grad, x64.grad),
            "padding_zero": bool(torch.all(got[~mask] == 0)),
            "parameter_grads_finite": all(p.grad is None or bool(torch.isfinite(p.grad).all())
                                          for p in layer.parameters()),
        }
    return results


def compare_with_float64(name: str, dtype: torch.dtype, *, tf32: bool = False, **sizes: Any) -> dict[str, Any]:
    """:func:`compare_runs_with_float64` for one run; a run that raises raises."""
    result = compare_runs_with_float64(name, {"run": (dtype, tf32)}, **sizes)["run"]
    if result.get("status") == "error":
        raise RuntimeError(f"{name} in {dtype}: {result['error']}")
    return result


def accuracy_bounds(name: str, dtype: torch.dtype) -> tuple[float, float]:
    out_bound, grad_bound = RATIOS[dtype]
    return out_bound, GRADIENT_BOUNDS.get(name, {}).get(dtype, grad_bound)


# ----------------------------------------------------------------------------- configuration


@dataclass
class GpuCheckConfig:
    """What ``longattn bench gpu`` measures; :meth:`smoke` shrinks every size for a CPU run in seconds."""

    device: str = "cuda"
    attentions: list[str] = field(default_factory=list)  # empty: every registered mechanism
    parts: list[str] = field(default_factory=lambda: ["compile", "accuracy", "speed", "train", "hf", "recall"])
    # compile: the ahead-of-time check (longattn.bench.aot) for the device's own architecture
    compile_attentions: list[str] = field(default_factory=list)  # empty: every registered mechanism
    compile_arch: int | None = None  # None: the CUDA device's (a CPU run names one to compile for)
    # seconds one row of the accuracy or speed part may run before it is recorded as timed out
    row_timeout_s: float = 60.0
    # accuracy
    accuracy_length: int = 1023
    accuracy_batch: int = 2
    accuracy_dim: int = 128
    accuracy_heads: int = 4
    # speed: the module forms at each length, tokens per call fixed (batch = tokens / N)
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    tokens: int = 65536
    dim: int = 512
    heads: int = 8
    warmup: int = 2
    repeats: int = 5
    # train
    train_task: str = "listops"
    train_preset: str = "demo"
    train_attention: str = "skeleton"
    train_steps: int = 100
    train_overrides: list[str] = field(default_factory=list)
    # hf
    hf_attentions: list[str] = field(default_factory=lambda: ["softmax", "skeleton", "nystrom"])
    hf_layers: int = 4
    hf_hidden: int = 256
    hf_heads: int = 4
    hf_length: int = 512
    hf_batch: int = 8
    # recall: the MQAR sweep's cost on this device (its presets in turn, each an even share of the part's time)
    recall_presets: list[str] = field(default_factory=lambda: ["cpu", "paper"])
    recall_attentions: list[str] = field(default_factory=list)  # empty: every row of the sweep file
    recall_lengths: list[int] = field(default_factory=list)  # empty: both arms
    recall_widths: list[int] = field(default_factory=lambda: [128])  # the middle width; empty: the sweep file's
    recall_overrides: list[str] = field(default_factory=list)
    # seconds for the whole run, and each part's share of it
    budget_s: float = 300.0
    shares: dict[str, float] = field(default_factory=lambda: {
        "compile": 0.05, "accuracy": 0.12, "speed": 0.49, "train": 0.11, "hf": 0.09, "recall": 0.14})
    seed: int = 0

    @classmethod
    def smoke(cls, **overrides: Any) -> "GpuCheckConfig":
        """Tiny sizes: every part and row runs, in seconds on a CPU."""
        sizes = dict(compile_attentions=["informer"], compile_arch=90, row_timeout_s=120.0, accuracy_length=65, accuracy_dim=16, accuracy_heads=2, lengths=[64, 128], tokens=256, dim=32,
                     heads=2, warmup=1, repeats=2, train_steps=3,
                     train_overrides=["data.train.num_examples=64", "data.val.num_examples=16",
                                      "data.test.num_examples=16", "train.batch_size=8"],
                     hf_layers=1, hf_hidden=32, hf_heads=2, hf_length=64, hf_batch=2,
                     recall_presets=["cpu"], recall_attentions=["softmax", "skeleton"], recall_lengths=[64],
                     recall_widths=[8], recall_overrides=[
                         "data.train_mix=[{seq_len: 64, num_kv_pairs: 4, examples: 16}]", "data.val_examples=8",
                         "data.test_examples=8", "train.batch_size=8", "train.epochs=1"],
                     budget_s=600.0)
        return cls(**{**sizes, **overrides})


# ----------------------------------------------------------------------------- the machine


def environment(device: torch.device) -> dict[str, Any]:
    """Device, library versions, float32 flags and date, for the header of every output."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "triton": None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if triton_installed():
        import triton

        info["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    else:
        info.update(device=f"cpu: {platform.processor() or platform.machine()}", cuda=None, cudnn=None,
                    threads=torch.get_num_threads())
    return info


class Clock:
    """Medians of calls: CUDA events on a GPU, wall time on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def median(self, fn: Callable[[], Any], repeats: int) -> float:
        return statistics.median(self.once(fn) for _ in range(repeats))


def machine_rates(device: torch.device, smoke: bool) -> dict[str, float]:
    """The bfloat16 GEMM rate (FLOP/s of a square product) and the copy bandwidth (bytes read + written
    per second of a large copy) measured on ``device``: the two rates of every row's floor."""
    clock = Clock(device)
    size = 256 if smoke else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    src = torch.empty((1 << 18) if smoke else (1 << 28), device=device, dtype=torch.float32)  # 1 GiB on a GPU
    dst = torch.empty_like(src)
    for _ in range(3):  # warm-up (cuBLAS picks its kernel, the clocks rise)
        a @ b
        dst.copy_(src)
    clock.sync()
    gemm = clock.median(lambda: a @ b, 10)
    copy_s = clock.median(lambda: dst.copy_(src), 10)
    return {"gemm_bf16_flop_per_s": 2 * size**3 / gemm, "copy_bytes_per_s": 2 * src.numel() * src.element_size() / copy_s,
            "gemm_size": size, "copy_bytes": src.numel() * src.element_size()}


# ----------------------------------------------------------------------------- parts


class Budget:
    """Seconds left for the whole run and for the part now running: a part gets its share of what is left,
    against the shares of the parts still to come (time a part leaves unused goes to the later ones)."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + total_s
        self.part_end = self.end

    def left(self) -> float:
        return min(self.end, self.part_end) - time.monotonic()

    @contextlib.contextmanager
    def part(self, share: float, shares_to_come: float) -> Iterator[None]:
        now = time.monotonic()
        self.part_end = now + max(0.0, self.end - now) * share / max(shares_to_come, share)
        try:
            yield
        finally:
            self.part_end = self.end


def _bounds_text() -> str:
    """The accuracy bounds in words: per dtype, then the gradient bounds of GRADIENT_BOUNDS (reasons beside it)."""
    short = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    per_dtype = "; ".join(f"{short[d]} {o:.0e}" + ("" if g == o else f" / {g:.0e}") for d, (o, g) in RATIOS.items())
    wider = ", ".join(f"{name} " + " / ".join(f"{short[d]} {bound:g}" for d, bound in bounds.items())
                      for name, bounds in GRADIENT_BOUNDS.items())
    return f"{per_dtype}; input gradient of {wider} (longattn.bench.gpu.GRADIENT_BOUNDS, with the reasons)"


def _names(config: GpuCheckConfig) -> list[str]:
    names = config.attentions or attention.available()
    unknown = sorted(set(names) - set(attention.available()))
    if unknown:
        raise ValueError(f"unknown attention(s) {unknown}; available: {', '.join(attention.available())}")
    return names


def _forced(device: torch.device) -> contextlib.AbstractContextManager:
    """On a CPU the GPU path is forced and CUDA's autocast rules emulated (the smoke run of the device code)."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(force_path("gpu"))
    stack.enter_context(CudaAutocastOnCPU())
    return stack


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


@contextlib.contextmanager
def row_time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the row running when it passes ``seconds`` (checked between Python bytecodes, so a
    CUDA call in flight finishes first); a no-op off the main thread, where signals cannot be set."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the row ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# The compile part's child: the suite's ahead-of-time check for one architecture, its report on stdout.
_COMPILE_SCRIPT = """
import json, sys
from longattn.bench.aot import AotConfig, run_aot
json.dump(run_aot(AotConfig.suite(**json.loads(sys.argv[1])), log=lambda line: print(line, file=sys.stderr)), sys.stdout)
"""


def run_compile_check(config: GpuCheckConfig, device: torch.device, budget: Budget, log: Callable[[str], None]) -> dict:
    """One configuration of every kernel the mechanisms launch compiled for this device's architecture
    (longattn.bench.aot), in a child process: a compiler that crashes or hangs fails this part only."""
    if config.compile_arch is not None:
        arch = config.compile_arch
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = 10 * major + minor
    else:
        return {"status": "skipped: no GPU architecture to compile for (set compile_arch)"}
    if arch not in SHARED_MEMORY_PER_BLOCK:
        return {"status": f"skipped: no shared-memory limit known for sm_{arch}", "arch": arch}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter's kernels cannot compile
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(attention.__file__).parents[2]), env.get("PYTHONPATH")]))
    arguments = {"archs": [arch], "attentions": config.compile_attentions or config.attentions,
                 "workers": max(1, os.cpu_count() or 1)}
    timeout = max(30.0, budget.left())
    try:
        done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(arguments)], env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"the compile check did not end in {timeout:.0f} s", "arch": arch}
    if done.returncode != 0:
        return {"status": "error", "error": (done.stderr.strip().splitlines() or ["no message"])[-1][:300], "arch": arch}
    report = json.loads(done.stdout)
    bad = [f"{r['module']}.{r['kernel']}: {r['status']} {r.get('error', '')}".strip() for r in report["rows"]
           if r["status"] != "ok"]
    result = {"status": "pass" if not bad else "fail", "arch": arch, "kernels": len(report["rows"]), "failures": bad,
              "spilling": [f"{r['module']}.{r['kernel']}: {r['spill_bytes']} B" for r in report["rows"]
                           if r.get("spills_over_limit")],
              "attentions": sorted({name for r in report["rows"] for name in r["attentions"]}),
              "rows": report["rows"], "seconds": report["seconds"]}
    log(f"compile sm_{arch}: {result['kernels']} kernels, {len(bad)} failing ({'; '.join(bad) or 'none'}), "
        f"{report['seconds']:.0f} s")
    return result


ACCURACY_RUNS: dict[str, Run] = {"fp32": (torch.float32, False), "fp32_tf32": (torch.float32, True),
                                  "bf16": (torch.bfloat16, False), "fp16": (torch.float16, False)}


def _measured(row: dict[str, Any]) -> bool:
    """Whether a row of an earlier run holds a measurement (a pass, a fail or an error: what ``--resume``
    keeps), not a row skipped for want of time."""
    statuses = [row["status"]] if "status" in row else [row[label].get("status", "") for label in ACCURACY_RUNS]
    return all(not status.startswith("skipped") for status in statuses)


def _earlier(earlier: Any, key: Callable[[dict], Any]) -> dict[Any, dict]:
    """The measured rows of an earlier run's part, by ``key`` (nothing if the part did not run or failed)."""
    return {key(row): row for row in earlier if _measured(row)} if isinstance(earlier, list) else {}


def run_accuracy(config: GpuCheckConfig, device: torch.device, budget: Budget, log: Callable[[str], None],
                 progress: Callable[[list], None] = lambda rows: None, earlier: Any = None,
                 first: list[str] = ()) -> list[dict]:
    """Per mechanism (those of ``first`` first: the ones with Triton kernels, so that the first seconds say
    whether the kernels agree with float64), its runs against float64; rows of ``earlier`` measured are kept."""
    rows: list[dict] = []
    done = _earlier(earlier, lambda row: row["attention"])
    names = _names(config)
    for name in [n for n in first if n in names] + [n for n in names if n not in first]:
        row: dict[str, Any] = {"attention": name}
        if name in done:
            rows.append(done[name])
            progress(rows)
            continue
        if budget.left() <= 0:
            rows.append({**row, **{label: {"status": "skipped: the accuracy part's time share is spent"}
                                   for label in ACCURACY_RUNS}})
            continue
        try:
            with row_time_limit(config.row_timeout_s):
                results = compare_runs_with_float64(name, ACCURACY_RUNS, device=device, length=config.accuracy_length,
                                                    batch=config.accuracy_batch, dim=config.accuracy_dim,
                                                    heads=config.accuracy_heads)
        except Exception as exc:  # noqa: BLE001 (the reference failed: every run of this mechanism says so)
            results = {label: {"status": "error", "error": _error(exc)} for label in ACCURACY_RUNS}
        for label, (dtype, _) in ACCURACY_RUNS.items():
            result = results[label]
            if result.get("status") != "error":
                out_bound, grad_bound = accuracy_bounds(name, dtype)
                passed = (result["dtype_ok"] and result["padding_zero"] and result["parameter_grads_finite"]
                          and result["out_ratio"] < out_bound and result["grad_ratio"] < grad_bound)
                result = {**result, "bounds": [out_bound, grad_bound], "status": "pass" if passed else "fail"}
            row[label] = result
        rows.append(row)
        progress(rows)
        log(f"accuracy {name}: " + ", ".join(
            f"{label} {row[label].get('out_ratio', float('nan')):.1e}/{row[label].get('grad_ratio', float('nan')):.1e}"
            f" {row[label]['status']}" for label in ACCURACY_RUNS))
    return rows


def kernels_run(name: str, length: int, config: GpuCheckConfig, device: torch.device) -> bool:
    """Whether one forward + backward of the module form under bfloat16 autocast (as the speed part runs it)
    dispatches other aten ops with the Triton kernels on than off: a kernel replaced some of them. Found by
    running rather than by reading the code because whether a kernel runs depends on the form and the dtype
    (the linear family's scan kernels, for one, run only in the causal form)."""
    torch.manual_seed(config.seed)
    layer = attention.build(name, dim=config.dim, heads=config.heads, max_len=length).to(device)
    x = torch.randn(1, length, config.dim, device=device, requires_grad=True)
    counts = []
    for enabled in (True, False):
        layer.zero_grad(set_to_none=True)  # a first backward creates the gradients, a second adds to them
        x.grad = None
        with (_forced(device), use_triton(enabled), DispatchCounter() as ops,
              torch.autocast(device.type, dtype=torch.bfloat16)):
            layer(x).float().sum().backward()
        counts.append(ops.counts)
    return counts[0] != counts[1]


def layer_flops(name: str, length: int, batch: int, config: GpuCheckConfig) -> int | None:
    """FLOPs of one forward + backward of the module form on its PyTorch GPU path (Triton off: kernels are
    invisible to the counter, and compute the same products), counted on meta tensors; None where the
    GPU path cannot run on meta tensors."""
    try:
        with torch.device("meta"):
            torch.manual_seed(config.seed)
            layer = attention.build(name, dim=config.dim, heads=config.heads, max_len=length)
        x = torch.empty(batch, length, config.dim, device="meta", requires_grad=True)
        with force_path("gpu"), use_triton(False):
            return count_flops(lambda: layer(x).sum().backward())
    except Exception:  # noqa: BLE001 (e.g. a path that reads a value back: no count, the row says so)
        return None


def _timed_row(name: str, length: int, batch: int, triton: bool | None, config: GpuCheckConfig,
               device: torch.device, clock: Clock, share_s: float) -> dict[str, Any]:
    """One (mechanism, length) row: median forward + backward seconds under bfloat16 autocast and the peak
    memory of one step above what was resident before it."""
    row: dict[str, Any] = {"attention": name, "length": length, "batch": batch,
                           "triton": triton}
    torch.manual_seed(config.seed)
    layer = attention.build(name, dim=config.dim, heads=config.heads, max_len=length).to(device)
    row["parameters"] = sum(p.numel() for p in layer.parameters())
    x = torch.randn(batch, length, config.dim, device=device, requires_grad=True)
    upstream = torch.randn(batch, length, config.dim, device=device, dtype=torch.bfloat16)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(x)
        out.backward(upstream.to(out.dtype))
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    with (use_triton(triton) if triton is not None else contextlib.nullcontext()):
        first = clock.once(step)  # compiles kernels, picks algorithms
        if config.warmup > 1:
            first = min(first, clock.once(step))
        repeats = max(1, min(config.repeats, int(share_s / max(first, 1e-6))))
        for _ in range(config.warmup - 2):
            clock.once(step)
        row["time_s"] = clock.median(step, repeats)
        row["repeats"] = repeats
        if repeats < config.repeats:
            row["note"] = f"{repeats} of {config.repeats} repeats: over its time share"
        row["peak_mib"] = peak_memory(step, device) / 2**20 if device.type == "cuda" else None
    return row


def speed_plan(names: list[str], config: GpuCheckConfig, device: torch.device,
               log: Callable[[str], None]) -> list[tuple[str, int, bool | None]]:
    """(mechanism, length, triton) per speed row: a row with the Triton kernels on and one with them off for
    each mechanism whose kernels run in the module form measured (:func:`kernels_run`, at the shortest
    length), one row (``None``: no switch) for the others and wherever no kernel can run."""
    with_kernels = set()
    if triton_installed() and device.type == "cuda":
        for name in names:
            try:
                if kernels_run(name, min(config.lengths), config, device):
                    with_kernels.add(name)
            except Exception as exc:  # noqa: BLE001 (its rows then report the error)
                log(f"speed {name}: could not tell whether its kernels run ({_error(exc)})")
        log(f"speed: Triton kernels run in the module forms of {', '.join(sorted(with_kernels)) or 'none'}")
    return [(name, length, triton) for name in names for length in config.lengths
            for triton in ([True, False] if name in with_kernels else [None])]


def run_speed_rows(config: GpuCheckConfig, device: torch.device, rates: dict[str, float], budget: Budget,
                   log: Callable[[str], None], progress: Callable[[list], None] = lambda rows: None,
                   earlier: Any = None) -> list[dict]:
    """Each planned (mechanism, length, triton) row, isolated (an exception or out of memory is the row's
    status); rows of ``earlier`` measured are kept, not measured again."""
    clock = Clock(device)
    names = _names(config)
    names = [SOFTMAX] + [n for n in names if n != SOFTMAX]
    done = _earlier(earlier, lambda row: (row["attention"], row["length"], row.get("triton")))
    if isinstance(earlier, list):  # the earlier run's plan (its Triton switches), and rows new to it
        plan = [(r["attention"], r["length"], r.get("triton")) for r in earlier]
        planned = {key[:2] for key in plan}
        plan += [(n, length, None) for n in names for length in config.lengths if (n, length) not in planned]
    else:
        plan = speed_plan(names, config, device, log)
    rows: list[dict] = []
    for index, (name, length, triton) in enumerate(plan):
        batch = max(1, config.tokens // length)
        left = budget.left()
        share = left / (len(plan) - index) / max(1, config.warmup + config.repeats) * config.repeats
        base = {"attention": name, "length": length, "batch": batch, "triton": triton}
        if (name, length, triton) in done:
            rows.append(done[name, length, triton])
            continue
        if left <= 0:
            rows.append({**base, "status": "skipped: the speed part's time share is spent"})
            continue
        try:
            with _forced(device), row_time_limit(config.row_timeout_s):
                row = _timed_row(name, length, batch, triton, config, device, clock, share)
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError:
            row = {**base, "status": "skipped: out of memory"}
        except Exception as exc:  # noqa: BLE001
            row = {**base, "status": "error", "error": _error(exc)}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if row["status"] == "ok":
            flops = layer_flops(name, length, batch, config) if budget.left() > 0 else None
            # activations in bfloat16 (autocast), float32 weights
            traffic = layer_traffic_bytes(batch * length * config.dim, row["parameters"], 2, 4)
            flop_floor = None if flops is None else flops / rates["gemm_bf16_flop_per_s"]
            byte_floor = traffic / rates["copy_bytes_per_s"]
            floor = max(byte_floor, flop_floor or 0.0)
            row.update(flops=flops, bytes=traffic, flop_floor_s=flop_floor, byte_floor_s=byte_floor, floor_s=floor,
                       floor_ratio=row["time_s"] / floor if floor else None,
                       floor_note=None if flops is not None else "FLOPs not counted (the GPU path does not run on "
                                                                 "meta tensors, or no time was left): byte floor only")
        rows.append(row)
        progress(rows)
        log(f"speed {name} N={length} B={batch}{'' if triton is None else ' triton ' + ('on' if triton else 'off')}: "
            + (f"{1000 * row['time_s']:.2f} ms" if row["status"] == "ok" else row["status"]))
    _add_softmax_ratios(rows)
    return rows


def _add_softmax_ratios(rows: list[dict]) -> None:
    """speedup = softmax module's time / the row's time, peak memory over softmax's, at the same length."""
    softmax = {r["length"]: r for r in rows if r["attention"] == SOFTMAX and r["status"] == "ok"}
    for row in rows:
        ref = softmax.get(row["length"])
        if row["status"] != "ok" or ref is None:
            continue
        row["speedup_vs_softmax"] = ref["time_s"] / row["time_s"]
        if ref.get("peak_mib"):
            row["memory_vs_softmax"] = row["peak_mib"] / ref["peak_mib"]


# The acceptance thresholds of the speed part: speed-up over the softmax module by length, per mechanism
# ("*" = every other sub-quadratic one), peak memory at 16k at most softmax's, within 3x of the floor at 64k.
SPEEDUP_TARGETS = {"skeleton": {4096: 1.0, 16384: 3.0, 65536: 10.0}, "*": {16384: 1.0, 65536: 2.0}}
MEMORY_LENGTH, FLOOR_LENGTH, FLOOR_RATIO = 16384, 65536, 3.0


def verdicts(rows: list[dict]) -> list[dict]:
    """Per sub-quadratic mechanism: each target at a measured length, the figure and whether it is met
    (None: the row did not run). Rows with Triton off are the PyTorch GPU path; the verdict takes the
    faster row."""
    lengths = {r["length"] for r in rows}
    best: dict[tuple[str, int], dict] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["attention"], row["length"])
        if key not in best or row["time_s"] < best[key]["time_s"]:
            best[key] = row
    out = []
    for name in sorted({r["attention"] for r in rows}):
        if name == SOFTMAX or not attention.capabilities(name).subquadratic:
            continue
        checks = []
        for length, target in SPEEDUP_TARGETS.get(name, SPEEDUP_TARGETS["*"]).items():
            got = best.get((name, length), {}).get("speedup_vs_softmax")
            checks.append({"check": f"speed-up vs softmax at N={length} >= {target}", "length": length, "value": got,
                           "met": None if got is None else got >= target})
        got = best.get((name, MEMORY_LENGTH), {}).get("memory_vs_softmax")
        checks.append({"check": f"peak memory at N={MEMORY_LENGTH} <= softmax's", "length": MEMORY_LENGTH,
                       "value": got, "met": None if got is None else got <= 1.0})
        got = best.get((name, FLOOR_LENGTH), {}).get("floor_ratio")
        checks.append({"check": f"time at N={FLOOR_LENGTH} within {FLOOR_RATIO}x of its floor", "length": FLOOR_LENGTH,
                       "value": got, "met": None if got is None else got <= FLOOR_RATIO})
        checks = [c for c in checks if c["length"] in lengths]
        if checks:
            out.append({"attention": name, "checks": checks})
    return out


def run_training(config: GpuCheckConfig, device: torch.device, out: Path, log: Callable[[str], None]) -> dict:
    """``train_steps`` steps of the LRA task in bfloat16 through the library's training loop."""
    from longattn.experiment.config import resolve_config
    from longattn.experiment.run import run

    steps = config.train_steps
    overrides = [f"train.max_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}", "train.precision=bf16",
                 f"train.device={device}", "train.progress=false", f"train.eval_every={steps}",
                 f"train.log_every={max(1, steps // 10)}", *config.train_overrides]
    run_config = resolve_config(config.train_task, config.train_preset, None, overrides,
                                attention=config.train_attention, seed=config.seed)
    with _forced(device):
        begin = time.monotonic()
        results = run(run_config, out / "train", plots=False)
    metrics = (out / "train" / "metrics.jsonl").read_text().splitlines()
    losses = [record["loss"] for record in map(json.loads, metrics) if record.get("split") == "train"]
    summary = {
        "task": config.train_task, "preset": config.train_preset, "attention": config.train_attention,
        "steps": results.get("steps"), "precision": results.get("precision"), "device": results.get("device"),
        "train_time_s": results.get("train_time_s"), "wall_s": time.monotonic() - begin,
        "steps_per_s": (results["steps"] / results["train_time_s"]) if results.get("train_time_s") else None,
        "peak_memory_mb": results.get("peak_memory_mb"), "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "losses_finite": bool(losses) and all(math.isfinite(v) for v in losses),
        "val": results.get("val"), "folder": str(out / "train"),
    }
    summary["status"] = "pass" if summary["steps"] == steps and summary["losses_finite"] else "fail"
    log(f"train {config.train_task} {config.train_attention}: {summary['steps']} steps, "
        f"{summary['steps_per_s'] or 0:.1f} steps/s, loss {summary['first_loss']} -> {summary['last_loss']}")
    return summary


def run_hf(config: GpuCheckConfig, device: torch.device, budget: Budget, log: Callable[[str], None],
           progress: Callable[[dict], None] = lambda result: None, earlier: Any = None) -> dict:
    """A BERT of random weights (transformers, no download) converted to each mechanism: forward + backward
    under bfloat16 autocast with padding; the softmax conversion also against the original in float32. Rows
    of ``earlier`` measured are kept."""
    import transformers

    from longattn.hf import convert

    bert_config = transformers.BertConfig(
        vocab_size=1000, hidden_size=config.hf_hidden, num_hidden_layers=config.hf_layers,
        num_attention_heads=config.hf_heads, intermediate_size=4 * config.hf_hidden,
        max_position_embeddings=config.hf_length, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(config.seed)
    original = transformers.BertModel(bert_config).to(device)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(5, 1000, (config.hf_batch, config.hf_length), generator=generator).to(device)
    mask = torch.ones(config.hf_batch, config.hf_length, dtype=torch.long)
    mask[0, config.hf_length // 2:] = 0  # one padded sequence
    mask = mask.to(device)
    clock = Clock(device)
    result: dict[str, Any] = {"model": f"BertModel, {config.hf_layers} layers, hidden {config.hf_hidden}, "
                                       f"{config.hf_heads} heads, random weights",
                              "batch": config.hf_batch, "length": config.hf_length, "rows": []}
    with torch.no_grad(), _forced(device):
        want = original.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        converted = convert(copy.deepcopy(original).eval(), SOFTMAX)
        got = converted(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    result["softmax_conversion_max_abs_diff_fp32"] = (got - want)[real].abs().max().item()
    done = _earlier((earlier or {}).get("rows") if isinstance(earlier, dict) else None, lambda row: row["attention"])
    for name in config.hf_attentions:
        row: dict[str, Any] = {"attention": name}
        if name in done:
            result["rows"].append(done[name])
            continue
        if budget.left() <= 0:
            result["rows"].append({**row, "status": "skipped: the hf part's time share is spent"})
            continue
        try:
            model = convert(copy.deepcopy(original).train(), name)
            parameters = [p for p in model.parameters() if p.requires_grad]

            def step() -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                hidden.float().square().mean().backward()
                return hidden

            with _forced(device):
                hidden = step()
                grads = [p.grad for p in parameters]
                new = [p for n, p in model.named_parameters() if "longattn" in n and p.requires_grad]
                row.update(
                    output_dtype=str(hidden.dtype).removeprefix("torch."),
                    output_finite=bool(torch.isfinite(hidden).all()),
                    grads_finite=all(g is None or bool(torch.isfinite(g).all()) for g in grads),
                    new_parameters_reached=all(p.grad is not None for p in new),
                    time_s=clock.median(lambda: (model.zero_grad(set_to_none=True), step()), 3),
                )
            row["status"] = "pass" if row["output_finite"] and row["grads_finite"] and row["new_parameters_reached"] \
                else "fail"
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", error=_error(exc))
        result["rows"].append(row)
        progress(result)
        log(f"hf {name}: {row['status']}" + (f", {1000 * row['time_s']:.1f} ms" if "time_s" in row else ""))
    return result


def run_recall_cost(config: GpuCheckConfig, device: torch.device, budget: Budget, log: Callable[[str], None]) -> dict:
    """What the MQAR sweep (``longattn paper zoology-fig2``, docs/mqar.md) costs on this device: a training step
    and an evaluated example of each (row, width) of each arm, at each preset, timed by the sweep's own
    ``--estimate`` code with ``train.device`` set to this device, until the preset's share of the time is spent
    (the cells not reached are listed)."""
    from longattn.experiment.recall import estimate_sweep_cost, load_recall_sweep, plan_sweep

    spec = load_recall_sweep("zoology_fig2")
    result: dict[str, Any] = {}
    for index, preset in enumerate(config.recall_presets):
        plan = plan_sweep(spec, preset, attentions=config.recall_attentions or None,
                          lengths=config.recall_lengths or None, widths=config.recall_widths or None,
                          extra_overrides=[f"train.device={device}", "train.progress=false", *config.recall_overrides])
        share_s = max(0.0, budget.left()) / (len(config.recall_presets) - index)
        cost = estimate_sweep_cost(plan, log=log, budget_s=share_s)
        result[preset] = cost
        log(f"recall sweep, preset {preset}: {cost['total_s'] / 3600:.1f} h on {cost['device'] or device} for the "
            f"{len(cost['cells'])} cells measured ({len(cost['unmeasured'])} not reached)")
    return result


# ----------------------------------------------------------------------------- the run and its tables


def run_gpu_check(config: GpuCheckConfig, out: str | Path, log: Callable[[str], None] = print,
                  save: Callable[[dict], None] = lambda report: None, earlier: dict | None = None) -> dict[str, Any]:
    """Run the parts of ``config.parts`` on ``config.device``; returns the report (JSON-ready). ``save`` gets the
    report after every row (so a run cut short leaves what it measured); the measured rows of ``earlier`` (an
    earlier report, ``--resume``) are kept and only the others run."""
    earlier = earlier or {}
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA device is available here (use --device cpu --smoke)")
    out = Path(out)
    budget = Budget(config.budget_s)
    report: dict[str, Any] = {"config": asdict(config), "environment": environment(device)}
    log(f"longattn bench gpu on {report['environment']['device']}, torch {report['environment']['torch']}, "
        f"triton {report['environment']['triton']}, CUDA {report['environment']['cuda']}")
    report["rates"] = machine_rates(device, smoke=device.type == "cpu")
    log(f"bf16 GEMM {report['rates']['gemm_bf16_flop_per_s'] / 1e12:.1f} TFLOP/s, "
        f"copy {report['rates']['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    def progress(part: str) -> Callable[[Any], None]:
        return lambda partial: (report.__setitem__(part, partial), save(report))

    def kernel_mechanisms() -> list[str]:  # those whose kernels the compile part reached, measured first
        return report.get("compile", {}).get("attentions", []) if isinstance(report.get("compile"), dict) else []

    parts = {
        "compile": lambda: run_compile_check(config, device, budget, log),
        "accuracy": lambda: run_accuracy(config, device, budget, log, progress("accuracy"), earlier.get("accuracy"),
                                         kernel_mechanisms()),
        "speed": lambda: run_speed_rows(config, device, report["rates"], budget, log, progress("speed"),
                                        earlier.get("speed")),
        "train": lambda: run_training(config, device, out, log),
        "hf": lambda: run_hf(config, device, budget, log, progress("hf"), earlier.get("hf")),
        "recall": lambda: run_recall_cost(config, device, budget, log),
    }
    for index, name in enumerate(config.parts):
        with budget.part(config.shares[name], sum(config.shares[p] for p in config.parts[index:])):
            begin = time.monotonic()
            try:
                if name in ("compile", "train", "recall") and _part_measured(earlier.get(name)):
                    report[name] = earlier[name]
                else:
                    report[name] = parts[name]()
            except Exception as exc:  # noqa: BLE001 (the other parts still run)
                report[name] = {"status": "error", "error": _error(exc), "traceback": traceback.format_exc()[-3000:]}
                log(f"{name}: {report[name]['error']}")
            report.setdefault("seconds", {})[name] = round(time.monotonic() - begin, 1)
            save(report)
    if isinstance(report.get("speed"), list):
        report["verdicts"] = verdicts(report["speed"])
    report["unmeasured"] = unmeasured(report)
    report.setdefault("seconds", {})["total"] = round(time.monotonic() - budget.start, 1)
    save(report)
    return report


def _part_measured(part: Any) -> bool:
    """Whether a whole part of an earlier report (compile, train, recall) holds its result."""
    return isinstance(part, dict) and bool(part) and not str(part.get("status", "")).startswith(("skipped", "error"))


def unmeasured(report: dict[str, Any]) -> list[str]:
    """The rows the run left unmeasured (skipped for want of time or memory), in words: what ``--resume``
    measures."""
    left = []
    for row in report.get("accuracy") or []:
        if isinstance(row, dict) and not _measured(row):
            left.append(f"accuracy {row['attention']}")
    for row in report.get("speed") or []:
        if isinstance(row, dict) and not _measured(row):
            triton = "" if row.get("triton") is None else f" triton {'on' if row['triton'] else 'off'}"
            left.append(f"speed {row['attention']} N={row['length']}{triton}")
    hf = report.get("hf")
    for row in hf.get("rows", []) if isinstance(hf, dict) else []:
        if not _measured(row):
            left.append(f"hf {row['attention']}")
    return left


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def gpu_tables(report: dict[str, Any]) -> str:
    """The markdown beside gpu.json: header, then one table per part."""
    from longattn.experiment.results import markdown_table

    env, rates = report["environment"], report["rates"]
    config = report["config"]
    lines = [f"# longattn bench gpu: {env['device']}",
             "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
             f"{env['date']}; float32 matmul precision {env['float32_matmul_precision']}. Measured: bf16 GEMM "
             f"{rates['gemm_bf16_flop_per_s'] / 1e12:.1f} TFLOP/s ({rates['gemm_size']}^3), copy "
             f"{rates['copy_bytes_per_s'] / 1e9:.0f} GB/s. Seconds per part: {report.get('seconds')}."]
    compiled = report.get("compile")
    if isinstance(compiled, dict) and "kernels" in compiled:
        lines += ["", f"## Kernels compiled ahead of time for sm_{compiled['arch']} (longattn.bench.aot)", "",
                  f"{compiled['kernels']} kernel configurations (one per kernel, bf16, head dim 64) of "
                  f"{', '.join(compiled['attentions'])}: {compiled['status']}, {compiled['seconds']:.0f} s."]
        lines += [f"- failing: {line}" for line in compiled["failures"]]
        lines += [f"- spilling: {line}" for line in compiled["spilling"]]
    accuracy = report.get("accuracy")
    if isinstance(accuracy, list):
        labels = ["fp32", "fp32_tf32", "bf16", "fp16"]
        rows = []
        for row in accuracy:
            cells = [row["attention"]]
            for label in labels:
                cell = row.get(label, {})
                cells.append(f"{_fmt(cell.get('out_ratio'), '.1e')} / {_fmt(cell.get('grad_ratio'), '.1e')} "
                             f"{cell.get('status', '-')}" if "out_ratio" in cell else cell.get("status", "-"))
            rows.append(cells)
        lines += ["", f"## Accuracy against float64 (N={config['accuracy_length']}, batch {config['accuracy_batch']}, "
                      f"dim {config['accuracy_dim']}, {config['accuracy_heads']} heads, scattered padding)", "",
                  f"RMS(error) / RMS(reference), output / input gradient. Bounds: {_bounds_text()}. fp32 with TF32 "
                  "convs: the library's convolutions in TF32 (allow_tf32), judged by the float32 bound. Set up so "
                  f"that every dtype makes the same discrete choices: {', '.join(SAME_CHOICES_IN_EVERY_DTYPE)} "
                  "(longattn.bench.gpu.SAME_CHOICES_IN_EVERY_DTYPE).", "",
                  markdown_table(["mechanism", "fp32", "fp32 with TF32 convs", "bf16", "fp16"], rows)]
        errors = [f"- {row['attention']} {label}: {row[label]['error']}" for row in accuracy for label in labels
                  if "error" in row.get(label, {})]
        if errors:
            lines += ["", *errors]
    speed = report.get("speed")
    if isinstance(speed, list):
        lengths = config["lengths"]
        middle = MEMORY_LENGTH if MEMORY_LENGTH in lengths else lengths[max(0, len(lengths) - 2)]
        keyed = {(r["attention"], r["length"], r.get("triton")): r for r in speed}
        rows = []
        for name, triton in dict.fromkeys((r["attention"], r.get("triton")) for r in speed):
            cells = [name if triton is None else f"{name} (triton {'on' if triton else 'off'})"]
            for length in lengths:
                r = keyed.get((name, length, triton), {})
                cells.append(_fmt(1000 * r["time_s"], ".1f") if r.get("status") == "ok" else
                             (r.get("status", "-").replace("skipped: ", "")[:24]))
            mid, top = keyed.get((name, middle, triton), {}), keyed.get((name, lengths[-1], triton), {})
            cells += [_fmt(mid.get("speedup_vs_softmax")), _fmt(top.get("speedup_vs_softmax")),
                      _fmt(mid.get("peak_mib"), ".0f"),
                      _fmt(None if top.get("floor_s") is None else 1000 * top["floor_s"], ".2f"),
                      _fmt(top.get("floor_ratio"), ".1f")]
            rows.append(cells)
        top = lengths[-1]
        lines += ["", f"## Forward + backward, bf16 autocast, {config['tokens']:,} tokens per call (batch = tokens / N), "
                      f"dim {config['dim']}, {config['heads']} heads: ms, "
                      f"{'CUDA-event' if env['cuda'] else 'wall-time'} medians", "",
                  "speed-up = softmax module's time / the row's; peak MiB = the most allocated during one step above "
                  "what was allocated before it (weights, input); floor = max(FLOPs at the bf16 GEMM rate, bytes at "
                  "the copy bandwidth); time / floor = how far the row is above it.", "",
                  markdown_table(["mechanism", *[f"N={n}" for n in lengths], f"vs softmax at {middle}", f"at {top}",
                                  f"peak MiB at {middle}", f"floor ms at {top}", f"time / floor at {top}"], rows)]
        notes = [f"- {r['attention']} N={r['length']}: {r.get('note') or r.get('error') or r['status']}"
                 for r in speed if r.get("note") or r["status"] not in ("ok",)]
        if notes:
            lines += ["", *notes]
    if report.get("verdicts"):
        rows = [[v["attention"], c["check"], _fmt(c["value"]), {True: "met", False: "NOT met", None: "-"}[c["met"]]]
                for v in report["verdicts"] for c in v["checks"]]
        lines += ["", "## Targets", "", markdown_table(["mechanism", "target", "measured", ""], rows)]
    train = report.get("train")
    if isinstance(train, dict) and "steps" in train:
        lines += ["", "## Training", "",
                  f"{train['task']} ({train['preset']} preset), {train['attention']}, {train['steps']} steps in "
                  f"{train['precision']} on {train['device']}: {_fmt(train['steps_per_s'], '.1f')} steps/s, loss "
                  f"{_fmt(train['first_loss'], '.3f')} -> {_fmt(train['last_loss'], '.3f')}, peak "
                  f"{_fmt(train['peak_memory_mb'], '.0f')} MB, validation {train['val']}: {train['status']}."]
    hf = report.get("hf")
    if isinstance(hf, dict) and "rows" in hf:
        rows = [[r["attention"], r.get("output_dtype", "-"), r.get("output_finite", "-"), r.get("grads_finite", "-"),
                 r.get("new_parameters_reached", "-"), _fmt(None if "time_s" not in r else 1000 * r["time_s"], ".1f"),
                 r["status"] + (f" ({r['error']})" if "error" in r else "")] for r in hf["rows"]]
        lines += ["", f"## Hugging Face bridge ({hf['model']}, batch {hf['batch']}, N={hf['length']}, bf16 autocast)",
                  "", f"softmax conversion against the original model in float32: max |difference| "
                      f"{hf['softmax_conversion_max_abs_diff_fp32']:.1e}.", "",
                  markdown_table(["mechanism", "output dtype", "output finite", "gradients finite",
                                  "new parameters get gradients", "fwd+bwd ms", "status"], rows)]
    recall = report.get("recall")
    if isinstance(recall, dict) and "status" not in recall:
        from longattn.experiment.recall import cost_estimate_text

        lines += ["", "## Recall sweep (MQAR): its cost on this device"]
        lines += ["\n" + cost_estimate_text(cost).rstrip() for cost in recall.values()]
    if report.get("unmeasured"):
        lines += ["", f"## Not measured ({len(report['unmeasured'])} rows: out of time or memory; `--resume` measures "
                      "them)", "", ", ".join(report["unmeasured"])]
    for part in ("compile", "accuracy", "speed", "train", "hf", "recall"):
        if isinstance(report.get(part), dict) and report[part].get("status") == "error":
            lines += ["", f"## {part}: error", "", f"    {report[part]['error']}"]
    return "\n".join(lines)
