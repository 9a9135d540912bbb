"""Speed and peak memory of attention mechanisms against sequence length.

Each (target, length) configuration runs in a fresh subprocess so that its peak memory can be
read from the process's peak RSS on CPU (``max_memory_allocated`` on GPU) without interference,
and so that running out of memory is recorded as such instead of crashing the whole run.

Times survive a loaded machine: every call is timed in wall time and in process CPU time
(``time.process_time``: on a single-thread CPU run it is the time the computation took whatever
else the machine runs); on GPU with CUDA events. Figures are medians of repeats after warm-up.
The SDPA baseline is measured again inside each configuration's process, its calls interleaved
with the target's repeat by repeat, so the speed-up of a row is a ratio of two medians taken side
by side under the same conditions. The floor of a row is what its counted FLOPs and its
unavoidable memory traffic cost at the GEMM rate and copy bandwidth the benchmark measures on
the machine (``machine_rates``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from longattn.bench.targets import SDPA, SDPA_MATH, math_backend, make_target
from longattn.utils import duration

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

# Defaults of ``longattn bench speed`` / ``bench model`` live here only; the command reads them.
DEFAULT_LENGTHS = "1k,4k,16k"
DEFAULT_TIMEOUT_S = 600.0
# SDPA is quadratic: beyond this length the in-process baseline (and the SDPA rows) are skipped,
# and no ratio is reported for those lengths.
DEFAULT_REFERENCE_MAX_LENGTH = 16384
MODEL_LENGTHS = "1k,2k,3k,4k"
MODEL_TIMEOUT_S = 900.0


@dataclass
class SpeedConfig:
    target: str
    length: int
    batch: int = 2
    heads: int = 2
    head_dim: int = 32
    device: str = "cpu"
    dtype: str = "float32"
    # one thread by default: process CPU time is then the honest cost on a shared machine
    threads: int = 1
    warmup: int = 1
    repeats: int = 5
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    # "layer": one attention layer, forward / forward+backward. "lra_text": SKTformer Table 4's
    # model-level benchmark, the standard LRA text classifier (2 layers, dim 64, vocab 257):
    # forward is inference, forward_backward one full training step with AdamW.
    # "classifier": the classifier of longattn.models.classifier built with ``model`` (the keywords of
    # build_classifier besides max_len, attention, heads and dim), e.g. Singularformer's Figure 5 model;
    # forward is inference (eval mode), forward_backward one training step with AdamW. "registered": the
    # registered classifier named by ``target`` built with ``model`` (its own attention); its in-process
    # baseline ``reference_target`` is then a registered classifier too (e.g. post_ln).
    kind: str = "layer"
    model: dict[str, Any] = field(default_factory=dict)
    # time only the forward (inference) and take the peak memory of a forward, not of forward+backward
    inference_only: bool = False
    # time SDPA in the same process, interleaved with the target (layer kind, target != SDPA)
    reference: bool = True
    # what that in-process baseline is: SDPA, or SDPA's math path (softmax_math: the n x n scores held)
    reference_target: str = SDPA
    # lra_text: micro-batches of ``batch`` per optimiser step (gradient accumulation, Skeinformer Table 2)
    grad_accum: int = 1

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def cpu_time_is_cost(self) -> bool:
        """Single-thread CPU runs are reported (and compared) in process CPU time."""
        return self.device == "cpu" and self.threads == 1


MODEL_DEFAULTS = SpeedConfig(target="", length=0, batch=32, repeats=3, kind="lra_text")


def _status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS (Linux).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def time_interleaved(calls: dict[str, Callable[[], None]], config: SpeedConfig) -> dict[str, dict[str, float | None]]:
    """Median wall and process-CPU seconds of each call over ``config.repeats`` rounds; each
    round runs every call once, so a change of machine load hits all of them alike."""
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    cuda = config.device.startswith("cuda")
    for _ in range(config.repeats):
        for name, fn in calls.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                wall[name].append(start.elapsed_time(end) / 1000)
                continue
            cpu0, wall0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - wall0)
            cpu[name].append(time.process_time() - cpu0)
    return {name: {"wall_s": statistics.median(wall[name]),
                   "cpu_s": statistics.median(cpu[name]) if cpu[name] else None} for name in calls}


def _lra_text_calls(config: SpeedConfig, target_name: str, device: torch.device):
    """The standard LRA text model with ``target_name`` attention, random byte tokens, AdamW."""
    import torch.nn.functional as F

    from longattn.models.classifier import build_classifier

    options = {} if target_name == SDPA else config.options
    model = build_classifier(vocab_size=257, num_classes=2, max_len=config.length, attention=target_name,
                             attention_options=options, heads=config.heads, dim=config.dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 257, (config.batch, config.length), device=device)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    labels = torch.randint(0, 2, (config.batch,), device=device)

    def forward() -> None:
        with torch.no_grad():
            model(tokens, mask)

    def train_step() -> None:
        for _ in range(config.grad_accum):
            (F.cross_entropy(model(tokens, mask), labels) / config.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model.train(), forward, train_step


def baseline_options(options: dict[str, Any]) -> dict[str, Any]:
    """What SDPA takes of a layer run's mechanism options: the causal form only, so that causal mechanisms are
    compared with causal SDPA (N / 2 keys per query on average), not with the bidirectional one."""
    return {"causal": options["causal"]} if "causal" in options else {}


def _layer_calls(config: SpeedConfig, target_name: str, device: torch.device):
    """(module, forward, forward_backward) of one attention layer on random [B, N, dim] input."""
    dtype = getattr(torch, config.dtype)
    options = baseline_options(config.options) if target_name in (SDPA, SDPA_MATH) else config.options
    target = make_target(target_name, config.dim, config.heads, config.length, options)
    module = target.module.to(device=device, dtype=dtype).train()
    x = torch.randn(config.batch, config.length, config.dim, device=device, dtype=dtype, requires_grad=True)
    mask = torch.ones(config.batch, config.length, dtype=torch.bool, device=device)

    def forward() -> None:
        with torch.no_grad(), target.context():
            target.call(x, mask)

    def forward_backward() -> None:
        with target.context():
            out = target.call(x, mask)
        out.sum().backward()
        x.grad = None
        module.zero_grad(set_to_none=True)

    return module, forward, forward_backward


def _classifier_calls(config: SpeedConfig, target_name: str, device: torch.device):
    """The classifier built from ``config.model`` with ``target_name`` attention (SDPA: ``softmax``, and
    ``softmax_math`` the same under SDPA's math path)."""
    from longattn.models.classifier import build_classifier

    baseline = target_name in (SDPA, SDPA_MATH)
    model = build_classifier(max_len=config.length, attention=SDPA if baseline else target_name,
                             attention_options={} if baseline else config.options,
                             heads=config.heads, dim=config.dim, **config.model)
    return _model_calls(model, config, device, math_backend if target_name == SDPA_MATH else contextlib.nullcontext)


def _registered_calls(config: SpeedConfig, target_name: str, device: torch.device):
    """The registered classifier ``target_name`` (e.g. a Table 4 model of Singularformer) built with
    ``config.model``, its own attention and sizes."""
    from longattn.models.registry import build_model

    model = build_model(target_name, family="classifier", max_len=config.length, **config.model)
    return _model_calls(model, config, device, contextlib.nullcontext)


def _model_calls(model: torch.nn.Module, config: SpeedConfig, device: torch.device, context: Callable):
    """(model, inference, training step) of a classifier ``model(inputs, mask)`` on random inputs: token
    ids, or vectors for an encoder with ``input_dim``; inference in eval mode, a training step with AdamW."""
    import torch.nn.functional as F

    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    encoder = model.encoder
    if getattr(encoder, "input_dim", None):
        inputs = torch.rand(config.batch, config.length, encoder.input_dim, device=device)
    else:
        inputs = torch.randint(0, encoder.vocab_size, (config.batch, config.length), device=device)
    mask = torch.ones(config.batch, config.length, dtype=torch.bool, device=device)
    labels = torch.randint(0, config.model.get("num_classes", 2), (config.batch,), device=device)

    def forward() -> None:
        model.eval()
        with torch.no_grad(), context():
            model(inputs, mask)

    def train_step() -> None:
        model.train()
        with context():
            loss = F.cross_entropy(model(inputs, mask), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, forward, train_step


_CALLS = {"layer": _layer_calls, "lra_text": _lra_text_calls, "classifier": _classifier_calls,
          "registered": _registered_calls}


def benchmark_calls(config: SpeedConfig, target: str):
    """(module, forward, forward_backward) of ``target`` as ``config.kind`` builds it (for other benchmarks
    that time with :func:`time_interleaved` and :func:`peak_memory`)."""
    if config.kind not in _CALLS:
        raise ValueError(f"unknown benchmark kind {config.kind!r}: one of {', '.join(_CALLS)}")
    return _CALLS[config.kind](config, target, torch.device(config.device))


def measure(config: SpeedConfig, part: str = "time") -> dict[str, Any]:
    """``part="time"``: FLOPs and times of forward and forward+backward of one configuration in
    this process (and SDPA's, interleaved, for a layer target other than SDPA when
    ``config.reference`` is set). ``part="memory"``: the peak memory of one forward+backward."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    module, forward, forward_backward = benchmark_calls(config, config.target)
    result: dict[str, Any] = {"parameters": sum(p.numel() for p in module.parameters())}
    step = forward if config.inference_only else forward_backward
    for _ in range(config.warmup):
        step()
    if part == "memory":
        return {**result, "peak_memory_bytes": peak_memory(step, device)}
    result["flops"] = count_flops(step)
    calls = {"forward": forward} if config.inference_only else {"forward": forward, "forward_backward": forward_backward}
    if config.reference and config.target not in (SDPA, SDPA_MATH, config.reference_target):
        _, sdpa_forward, sdpa_forward_backward = benchmark_calls(config, config.reference_target)
        for _ in range(max(1, config.warmup)):
            (sdpa_forward if config.inference_only else sdpa_forward_backward)()
        calls["sdpa_forward"] = sdpa_forward
        if not config.inference_only:
            calls["sdpa_forward_backward"] = sdpa_forward_backward
    for name, times in time_interleaved(calls, config).items():
        result[f"{name}_wall_s"] = times["wall_s"]
        result[f"{name}_cpu_s"] = times["cpu_s"]
        # the figure a row is compared by: CPU time on single-thread CPU runs, wall time otherwise
        result[f"{name}_s"] = times["cpu_s"] if config.cpu_time_is_cost else times["wall_s"]
    if "sdpa_forward_backward_s" in result:
        result["speedup_vs_sdpa"] = result["sdpa_forward_backward_s"] / result["forward_backward_s"]
    if "sdpa_forward_s" in result:
        result["forward_speedup_vs_sdpa"] = result["sdpa_forward_s"] / result["forward_s"]
    return result


def peak_memory(forward_backward: Callable[[], None], device: torch.device) -> int:
    """Peak memory of one step (forward+backward, or the forward alone) above what is resident before
    it (model and inputs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward_backward()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    before = _status_bytes("VmRSS")
    _reset_peak_rss()
    forward_backward()
    return max(0, _status_bytes("VmHWM") - before)


# ----------------------------------------------------------------------------- FLOP count


def _fft_flops(real_length: int, transforms: int, complex_input: bool) -> int:
    # 5 n log2 n real operations per complex transform of length n (the radix-2 count);
    # a real-to-complex or complex-to-real transform of length n costs half of that
    return int((5 if complex_input else 2.5) * real_length * math.log2(max(real_length, 2)) * transforms)


def _r2c_flops(input_shape, dim, normalization, onesided, out_shape=None, **kwargs) -> int:
    n = math.prod(input_shape[d] for d in dim)
    return _fft_flops(n, math.prod(input_shape) // n, complex_input=False)


def _c2r_flops(input_shape, dim, normalization, last_dim_size, out_shape=None, **kwargs) -> int:
    n = math.prod(out_shape[d] for d in dim)
    return _fft_flops(n, math.prod(out_shape) // n, complex_input=False)


def _c2c_flops(input_shape, dim, normalization, forward, out_shape=None, **kwargs) -> int:
    n = math.prod(input_shape[d] for d in dim)
    return _fft_flops(n, math.prod(input_shape) // n, complex_input=True)


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> "FlopCounterMode":
    """torch's FlopCounterMode (FLOPs from each op's shapes: matmuls, convolutions, attention
    kernels; a multiply-add counts 2) taught the ops it does not know: the FFTs, SDPA's CPU
    kernels and the in-place GEMM ``addmm_`` (the skeleton's fused stem). Elementwise ops and
    reductions are not counted: they are memory traffic. Use as ``with flop_counter() as counter: ...``."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    custom = {aten._fft_r2c: _r2c_flops, aten._fft_c2r: _c2r_flops, aten._fft_c2c: _c2c_flops,
              aten.addmm_: _addmm_flops,
              aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
              aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops}
    return FlopCounterMode(display=False, custom_mapping=custom)


def count_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of ``step`` as :func:`flop_counter` counts them."""
    with flop_counter() as counter:
        step()
    return int(counter.get_total_flops())


def child_env(config: SpeedConfig) -> dict[str, str]:
    # the child imports this very copy of longattn, whatever is installed
    src_dir = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, OMP_NUM_THREADS=str(config.threads),
                PYTHONPATH=os.pathsep.join(filter(None, [src_dir, os.environ.get("PYTHONPATH")])))


# glibc serves a block at least this large with its own mmap and unmaps it when freed; fixed
# (not glibc's adaptive threshold) in the memory process, the peak RSS of a step is the peak of
# its live tensors instead of depending on which freed blocks earlier steps left in the heap
MEMORY_PROCESS_MMAP_THRESHOLD = 1 << 20


class RowProgress:
    """Progress of a grid of measurements by the clock: while a row's process runs, :meth:`beat` (called about
    every second) writes a line once ``every_s`` seconds passed since the last one (the bar alone moves only
    when a row ends, and one row may take minutes): the row under way, elapsed time and time left."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    every_s = 60.0

    def __init__(self, total: int, write: Callable[[str], Any] | None = None) -> None:
        self.total, self.ended = total, 0
        self.write = write or (lambda line: print(line, flush=True))
        self.started = self.last_line = self.row_started = self.clock()
        self.row = ""

    def begin(self, row: str, ended: int) -> None:
        """Row ``row`` starts, ``ended`` rows before it done."""
        self.row, self.row_started, self.ended = row, self.clock(), ended

    def beat(self) -> None:
        now = self.clock()
        if now - self.last_line < self.every_s:
            return
        elapsed = now - self.started
        left = f", about {duration(elapsed / self.ended * (self.total - self.ended))} left" if self.ended else ""
        self.write(f"bench: row {self.ended + 1}/{self.total} ({self.row}) under way for "
                   f"{duration(now - self.row_started)}; elapsed {duration(elapsed)}{left}")
        self.last_line = now


def _communicate(proc: subprocess.Popen, timeout_s: float, beat: Callable[[], None]) -> tuple[str, str]:
    """``proc.communicate`` within ``timeout_s``, calling ``beat`` about every second while it waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                proc.kill()
                proc.communicate()
                raise
            beat()


def run_in_subprocess(config: SpeedConfig, timeout_s: float, memory_limit_bytes: int | None,
                      parts: tuple[str, ...] = ("memory", "time"),
                      beat: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Measure ``config`` in fresh Python processes, the peak memory in one (CPU: glibc's mmap
    threshold fixed, see MEMORY_PROCESS_MMAP_THRESHOLD) and the times in another (the default
    allocator behaviour), or only the ``parts`` asked for; out-of-memory and time-outs become statuses.
    ``beat`` is called about every second while a process runs (:class:`RowProgress`)."""
    row: dict[str, Any] = asdict(config)
    env = child_env(config)
    if memory_limit_bytes:
        env["LONGATTN_BENCH_MEMORY_LIMIT"] = str(memory_limit_bytes)
    memory_env = dict(env, MALLOC_MMAP_THRESHOLD_=str(MEMORY_PROCESS_MMAP_THRESHOLD))
    for part, part_env in (("memory", memory_env), ("time", env)):
        if part not in parts:
            continue
        cmd = [sys.executable, "-m", "longattn.bench.speed", json.dumps(asdict(config)), part]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=part_env)
        try:
            stdout, stderr = _communicate(proc, timeout_s, beat)
        except subprocess.TimeoutExpired:
            return {**row, "status": "timeout"}
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            err = stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            oom = proc.returncode in (-9, 137) or any(
                s in stderr for s in ("can't allocate memory", "out of memory", "OutOfMemoryError", "MemoryError")
            )
            return {**row, "status": "oom" if oom else "error", "error": err[0]}
        row.update(json.loads(lines[-1]))
    return row


def _worker(config_json: str, part: str) -> None:
    limit = os.environ.get("LONGATTN_BENCH_MEMORY_LIMIT")
    if limit:
        # Cap the address space so running out of memory is a clean allocation failure in this
        # process instead of the kernel's OOM killer hitting something else on the machine.
        resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))
    config = SpeedConfig(**json.loads(config_json))
    print(json.dumps({"status": "ok", **measure(config, part)}), flush=True)


# ----------------------------------------------------------------------------- machine floor


def machine_rates(device: str = "cpu", dtype: str = "float32", threads: int = 1, repeats: int = 7) -> dict[str, float]:
    """The machine's float GEMM rate (FLOP/s, a 1024^3 product in ``dtype``) and copy bandwidth
    (bytes/s, read + write of 256 MiB), medians of repeats, timed like the targets (process CPU
    time on single-thread CPU runs)."""
    torch.set_num_threads(threads)
    config = SpeedConfig(target="", length=0, device=device, dtype=dtype, threads=threads, repeats=repeats)
    size = 1024
    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    src = torch.randn(64 * 2**20, device=device)  # 256 MiB of float32
    dst = torch.empty_like(src)
    a @ b, dst.copy_(src)  # warm-up
    times = time_interleaved({"gemm": lambda: a @ b, "copy": lambda: dst.copy_(src)}, config)
    key = "cpu_s" if config.cpu_time_is_cost else "wall_s"
    return {"gemm_flop_per_s": 2 * size**3 / times["gemm"][key],
            "copy_bytes_per_s": 2 * src.numel() * src.element_size() / times["copy"][key]}


def traffic_bytes(config: SpeedConfig, parameters: int) -> int:
    """Bytes forward+backward of an attention layer must move at the very least (:func:`layer_traffic_bytes`)."""
    item = torch.finfo(getattr(torch, config.dtype)).bits // 8
    return layer_traffic_bytes(config.batch * config.length * config.dim, parameters, item, item)


def layer_traffic_bytes(activations: int, parameters: int, activation_item: int, parameter_item: int) -> int:
    """Bytes forward+backward of an attention layer must move at the very least, for ``activations``
    elements of x (and of y) and ``parameters`` weights of the given byte sizes.

    Forward reads x and writes y; backward reads dy and x and writes dx; every parameter is read
    twice (forward and backward) and its gradient written once. Anything beyond this (scores,
    samples, FFT buffers) is the mechanism's own overhead, which the floor ratio exposes.
    """
    return 5 * activations * activation_item + 3 * parameters * parameter_item


def add_floor(row: dict[str, Any], config: SpeedConfig, rates: dict[str, float]) -> None:
    """Per-token FLOPs and bytes of a measured layer row, the time they take at the machine's
    rates (the larger of the two: a roofline), and how far the measured time is above it."""
    tokens = config.batch * config.length
    traffic = traffic_bytes(config, row["parameters"])
    floor = max(row["flops"] / rates["gemm_flop_per_s"], traffic / rates["copy_bytes_per_s"])
    row.update(flop_per_token=row["flops"] / tokens, bytes_per_token=traffic / tokens,
               floor_s=floor, floor_ratio=row["forward_backward_s"] / floor)


def _machine_rates_in_subprocess(base: SpeedConfig, timeout_s: float) -> dict[str, float]:
    code = ("import json, sys; from longattn.bench.speed import machine_rates; "
            "print(json.dumps(machine_rates(*sys.argv[1:3], int(sys.argv[3]))))")
    proc = subprocess.run([sys.executable, "-c", code, base.device, base.dtype, str(base.threads)],
                          capture_output=True, text=True, timeout=timeout_s, env=child_env(base))
    if proc.returncode != 0:
        raise RuntimeError(f"measuring the machine's rates failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- run, report, plot


def run_speed(
    targets: list[str],
    lengths: list[int],
    base: SpeedConfig | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_limit_bytes: int | None = None,
    progress: bool = True,
    reference_max_length: int = DEFAULT_REFERENCE_MAX_LENGTH,
) -> list[dict[str, Any]]:
    """Measure every target at every length (each in its own subprocess).

    SDPA (and its math path) rows beyond ``reference_max_length`` are skipped, and so is the
    in-process SDPA baseline of the other targets there.
    """
    from tqdm import tqdm

    base = base or SpeedConfig(target="", length=0)
    rates = _machine_rates_in_subprocess(base, timeout_s) if base.kind == "layer" else {}
    rows = []
    grid = [(t, n) for n in lengths for t in targets]
    skip: set[str] = set()  # once a target runs out of memory or time, longer lengths will too
    bar = tqdm(grid, desc="bench speed", disable=not progress)
    lines = RowProgress(len(grid), write=tqdm.write if progress else lambda line: None)
    for target, length in bar:
        lines.begin(f"{target} at N={length}", len(rows))
        beyond_reference = length > reference_max_length
        config = SpeedConfig(**{**asdict(base), "target": target, "length": length,
                                "reference": base.reference and not beyond_reference})
        if target in skip:
            rows.append({**asdict(config), "status": "skipped (failed at a shorter length)"})
            continue
        if target in (SDPA, SDPA_MATH) and beyond_reference:
            rows.append({**asdict(config), "status": f"skipped (N > {reference_max_length})"})
            continue
        row = run_in_subprocess(config, timeout_s, memory_limit_bytes, beat=lines.beat)
        if row["status"] == "ok" and config.kind == "layer":
            add_floor(row, config, rates)
            row.update(rates)
        elif row["status"] != "ok":
            skip.add(target)
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def clock_of(rows: list[dict[str, Any]]) -> str:
    """What the times of a run are: process CPU time (single-thread CPU) or wall time."""
    config = next((r for r in rows), None)
    if config is None:
        return ""
    single = SpeedConfig(target="", length=0, device=config["device"], threads=config["threads"]).cpu_time_is_cost
    return "process CPU time, 1 thread" if single else f"wall time, {config['threads']} threads on {config['device']}"


def _speedup(row: dict[str, Any], reference: str) -> float | None:
    """The row's speed-up over SDPA measured side by side in its own process (1 for SDPA itself)."""
    return 1.0 if row["target"] == reference else row.get("speedup_vs_sdpa")


def speed_table(rows: list[dict[str, Any]], reference: str = SDPA) -> str:
    """Markdown table per target and length: times (median; the clock is named above the table),
    wall time beside them, SDPA measured in the same process and the ratio of the two, peak memory
    and its ratio to SDPA's, FLOPs and bytes per token and the time over the machine floor."""
    ref = {r["length"]: r for r in rows if r["target"] == reference and r.get("status") == "ok"}
    lines = [
        f"Times: median, {clock_of(rows)}; SDPA re-measured in each row's process.",
        "",
        "| target | N | fwd ms | fwd+bwd ms | fwd+bwd wall ms | SDPA fwd+bwd ms | speed-up vs SDPA | peak MiB "
        "| memory vs SDPA | kFLOP/token | bytes/token | x floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["target"], r["length"])):
        if r.get("status") != "ok":
            lines.append(f"| {r['target']} | {r['length']} | {r.get('status')} |" + " |" * 9)
            continue
        base = ref.get(r["length"])
        mem = r["peak_memory_bytes"] / base["peak_memory_bytes"] if base and base["peak_memory_bytes"] else None
        sdpa = r["forward_backward_s"] if r["target"] == reference else r.get("sdpa_forward_backward_s")
        lines.append(
            f"| {r['target']} | {r['length']} | {_fmt(1000 * r['forward_s'], '.1f')} | "
            f"{_fmt(1000 * r['forward_backward_s'], '.1f')} | {_fmt(1000 * r['forward_backward_wall_s'], '.1f')} | "
            f"{_fmt(None if sdpa is None else 1000 * sdpa, '.1f')} | {_fmt(_speedup(r, reference), '.2f')} | "
            f"{_fmt(r['peak_memory_bytes'] / 2**20, '.1f')} | {_fmt(mem, '.2f')} | "
            f"{_fmt(None if r.get('flop_per_token') is None else r['flop_per_token'] / 1000, '.1f')} | "
            f"{_fmt(r.get('bytes_per_token'), '.0f')} | {_fmt(r.get('floor_ratio'), '.1f')} |"
        )
    return "\n".join(lines)


def _table_against_reference(rows: list[dict[str, Any]], reference: str, note: str, columns: tuple[str, str],
                             cells: Callable[[dict[str, Any]], tuple[str, str]]) -> str:
    """Markdown table per (target, N) of a time cell and a memory cell (``cells``), each followed by its
    ratio to ``reference`` (its speed measured in the same process, its memory in its own row)."""
    ref = {r["length"]: r for r in rows if r["target"] == reference and r.get("status") == "ok"}
    lines = [f"Times: median, {clock_of(rows)}{note}.", "",
             f"| attention | N | {columns[0]} | speed-up vs softmax | {columns[1]} | memory vs softmax |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["target"], r["length"])):
        if r.get("status") != "ok":
            lines.append(f"| {r['target']} | {r['length']} | {r.get('status')} | | | |")
            continue
        base = ref.get(r["length"])
        mem = r["peak_memory_bytes"] / base["peak_memory_bytes"] if base and base["peak_memory_bytes"] else None
        time_cell, memory_cell = cells(r)
        lines.append(f"| {r['target']} | {r['length']} | {time_cell} | {_fmt(_speedup(r, reference), '.2f')} | "
                     f"{memory_cell} | {_fmt(mem, '.2f')} |")
    return "\n".join(lines)


def model_table(rows: list[dict[str, Any]], reference: str = SDPA) -> str:
    """Markdown table of the model-level benchmark (SKTformer Table 4 layout): training steps per
    second and peak memory per length, with ratios to the softmax model."""
    return _table_against_reference(
        rows, reference, "", ("train steps/s", "peak MiB"),
        lambda r: (f"{1 / r['forward_backward_s']:.2f}", f"{r['peak_memory_bytes'] / 2**20:.0f}"))


def per_sequence_table(rows: list[dict[str, Any]], reference: str = SDPA) -> str:
    """Markdown table of FSAT Figure 3's figures: training time and peak memory per sequence (a
    training step's, divided by the batch) against N, with ratios to the softmax model."""
    return _table_against_reference(
        rows, reference, "; one training step divided by its batch", ("train ms / sequence", "peak MiB / sequence"),
        lambda r: (f"{1000 * r['forward_backward_s'] / r['batch']:.1f}",
                   f"{r['peak_memory_bytes'] / 2**20 / r['batch']:.1f}"))


def growth(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per target, how much faster than linear time and memory grow from the shortest to the longest
    measured length: (t_long / t_short) / (N_long / N_short); 1.0 is exactly linear."""
    out = {}
    for target in sorted({r["target"] for r in rows}):
        ok = sorted((r for r in rows if r["target"] == target and r.get("status") == "ok"), key=lambda r: r["length"])
        if len(ok) < 2:
            continue
        lo, hi = ok[0], ok[-1]
        scale = hi["length"] / lo["length"]
        out[target] = {
            "from": lo["length"],
            "to": hi["length"],
            "time": hi["forward_backward_s"] / lo["forward_backward_s"] / scale,
            "memory": (hi["peak_memory_bytes"] / lo["peak_memory_bytes"] / scale) if lo["peak_memory_bytes"] else float("nan"),
        }
    return out


def plot_speed(rows: list[dict[str, Any]], path: str | Path, per_sequence: bool = False) -> None:
    """Log-log plot of forward+backward time and peak memory against N, with a slope-1 guide;
    ``per_sequence`` divides both by the batch (FSAT Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = " per sequence" if per_sequence else ""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, label in ((axes[0], "forward_backward_s", f"forward+backward time{unit} (s)"),
                           (axes[1], "peak_memory_bytes", f"peak memory{unit} (bytes)")):
        lengths = sorted({r["length"] for r in rows})
        ok = [r for r in rows if r.get("status") == "ok" and r.get(key)]

        def value(r: dict[str, Any]) -> float:
            return r[key] / r["batch"] if per_sequence else r[key]

        for target in sorted({r["target"] for r in rows}):
            pts = sorted((r["length"], value(r)) for r in ok if r["target"] == target)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=target)
        values = [value(r) for r in ok]
        if values and len(lengths) > 1:
            y0 = min(values)
            ax.plot(lengths, [y0 * n / lengths[0] for n in lengths], "k--", lw=1, label="slope 1 (linear)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "time")
