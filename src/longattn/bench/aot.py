"""Every Triton kernel the library launches, compiled ahead of time for real GPUs, on a CPU.

Triton's interpreter, which the tests run the kernels in, accepts what the real compiler and the
hardware refuse (shared memory over a block's limit, register spills, compile times of minutes).
``triton.compile`` needs no GPU and no driver: it lowers a kernel through PTX to a cubin with the
bundled ``ptxas``. This module drives every registered mechanism's module form, forward and backward,
on meta tensors inside :func:`~longattn.attention._triton.capture_launches` (nothing is computed; the
launchers run as on a GPU and each launch is recorded with its real arguments and constexprs), then
compiles each distinct launch for each target and reports, per (kernel, configuration): compiled or
the compiler's error, the shared memory the kernel needs against the target's per-block limit, the
registers and spill bytes of ptxas's log, the compile time, and two hazards read from the kernel's TTIR
(:func:`ttir_hazards`) that the interpreter cannot show: 32-bit address products and unsynchronised re-reads
of global memory.

The matrix is every registered mechanism (a mechanism added to the registry is covered without editing
this file) x dtype (bf16, fp16, float32) x head dim x sequence class (short, long) x form (bidirectional,
and causal where the mechanism has it: the linear family's scan kernels run only there). Half dtypes are
the module cast to that dtype: autocast does not apply to meta tensors, and the launchers see the same
dtypes either way (each casts its operands to one dtype).

``longattn bench compile`` runs it; tests/bench/test_aot.py compiles one configuration per kernel.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from longattn import attention
from longattn.attention import force_path
from longattn.attention._triton import SHARED_MEMORY_PER_BLOCK, Launch, capture_launches

__all__ = ["AotConfig", "Form", "aot_table", "capture_forms", "compile_launch", "run_aot"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# A compile slower than this is a finding in itself (the bound); the child compiling it is stopped.
COMPILE_TIMEOUT_S = 60.0
# Spill bytes (stores + loads) above which a configuration is reported as spilling.
SPILL_LIMIT_BYTES = 4096
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# One operation of the TTIR (MLIR's textual form): its results, its name, the rest of the line.
_TTIR_OP = re.compile(r"^\s*(?:(%[\w.$-]+)(?::\d+)? = )?([a-z_]+\.[\w.]+)(.*)$")
_TTIR_VALUE = re.compile(r"%[\w.$-]+")
_TTIR_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_TTIR_FILE_LOC = re.compile(r'^"([^"]+)":(\d+):\d+')
# tl.debug_barrier() in the TTIR (its name by triton version)
_TTIR_BARRIERS = ("gpu.barrier", "ttg.barrier")
# Shape operations: a constant splat, broadcast, expanded or reshaped is still a constant.
_TTIR_CONSTANT_SHAPING = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape")


@dataclass(frozen=True)
class Form:
    """One way the module form is driven: its dtype, head dim, sequence length and causality."""

    dtype: str
    head_dim: int
    length: int
    causal: bool

    def label(self) -> str:
        return f"{self.dtype} Dh={self.head_dim} N={self.length}{' causal' if self.causal else ''}"


@dataclass
class AotConfig:
    """What :func:`run_aot` compiles; :meth:`suite` is the test suite's one configuration per kernel."""

    archs: list[int] = field(default_factory=lambda: [80, 90])
    attentions: list[str] = field(default_factory=list)  # empty: every registered mechanism
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    head_dims: list[int] = field(default_factory=lambda: [64, 128])
    lengths: list[int] = field(default_factory=lambda: [1023, 65536])  # a short (odd) and a long class
    heads: int = 4
    batch: int = 2
    timeout_s: float = COMPILE_TIMEOUT_S
    one_per_kernel: bool = False  # compile only the first configuration captured of each kernel
    workers: int = 2  # compiles at a time (each a forked process)

    @classmethod
    def suite(cls, **overrides: Any) -> "AotConfig":
        """bf16 at head dim 64, one short length, the first configuration of each kernel: every kernel once
        per target (the CI check)."""
        return cls(**{**dict(dtypes=["bf16"], head_dims=[64], lengths=[1023], one_per_kernel=True), **overrides})

    def forms(self, causal: bool) -> list[Form]:
        return [Form(dtype, head_dim, length, is_causal) for dtype in self.dtypes for head_dim in self.head_dims
                for length in self.lengths for is_causal in ((False, True) if causal else (False,))]


def capture_forms(name: str, forms: list[Form], heads: int, batch: int) -> tuple[list[tuple[Form, Launch]], list[dict]]:
    """The launches of one forward + backward of ``name``'s module form in each form, on meta tensors;
    and the forms the mechanism does not build or run (with the reason: a head dim it refuses, say)."""
    launches: list[tuple[Form, Launch]] = []
    refused: list[dict] = []
    for form in forms:
        dim = heads * form.head_dim
        try:
            with torch.device("meta"):
                torch.manual_seed(0)
                layer = attention.build(name, dim=dim, heads=heads, max_len=form.length,
                                        causal=form.causal).to(DTYPES[form.dtype])
            x = torch.empty(batch, form.length, dim, device="meta", dtype=DTYPES[form.dtype], requires_grad=True)
            with capture_launches() as captured, force_path("gpu"):
                layer(x).sum().backward()
        except Exception as exc:  # noqa: BLE001 (a form the mechanism refuses is reported, not fatal)
            refused.append({"attention": name, "form": form.label(), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        launches += [(form, launch) for launch in captured]
    return launches, refused


def _signature(launch: Launch, arch: int) -> tuple[Any, dict, dict, dict, Any]:
    """What ``JITFunction.run`` would compile for this launch on ``arch``: the target, signature, constexprs,
    attributes (alignment specialisations) and options, by triton's own binder."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", kernel.debug or knobs.runtime.debug)
    kwargs.setdefault("instrumentation_mode", knobs.compilation.instrumentation_mode)
    kwargs.setdefault("fpsan_homomorphic_casts", knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return target, signature, constexprs, attrs, options


def launch_key(launch: Launch) -> str:
    """The configuration class of a launch: the kernel, its pointer dtypes, its constexprs other than the
    on/off switches (tile sizes, head-dim blocks, precision, accumulator) and its options. These set the
    shared memory and the shape of the code; the switches (CAUSAL, HAS_MASK, ...) add masks and branches, and
    of the launches of one class :func:`run_aot` compiles the one with the most switches on."""
    _, signature, constexprs, _, options = _signature(launch, 90)
    pointers = sorted({kind for kind in signature.values() if kind.startswith("*")})
    sizes = {path: value for path, value in constexprs.items() if not isinstance(value, bool)}
    return f"{launch.kernel.fn.__module__}.{launch.name}|{pointers}|{sizes}|{options}"


def _switches_on(launch: Launch) -> int:
    _, _, constexprs, _, _ = _signature(launch, 90)
    return sum(value is True for value in constexprs.values())


def _describe(launch: Launch) -> dict[str, Any]:
    """The launch in words: tensor dtypes, constexprs and launch options."""
    kernel = launch.kernel
    names = [p.name for p in kernel.params]
    bound = dict(zip(names, launch.args)) | launch.kwargs
    constexprs = {p.name: bound.get(p.name) for p in kernel.params if p.is_constexpr}
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in bound.values() if isinstance(v, torch.Tensor)
                     and v.is_floating_point()})
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    return {"kernel": launch.name, "module": kernel.fn.__module__.rsplit(".", 1)[-1], "dtypes": dtypes,
            "constexprs": {k: (str(v) if not isinstance(v, (int, float, bool, type(None))) else v)
                           for k, v in constexprs.items()}, "options": options}


@dataclass
class _TtirOp:
    result: str | None
    name: str
    operands: list[str]
    result_type: str
    location: str
    regions: tuple[int, ...]  # the lines of the operations whose regions hold this one, outermost first


def _ttir_ops(ttir: str) -> tuple[list[_TtirOp], dict[str, str]]:
    """The operations of a TTIR module in order, and its location aliases (``#loc12`` -> its text)."""
    aliases = {m.group(1): m.group(2) for m in map(_TTIR_LOC_DEF.match, ttir.splitlines()) if m}
    ops: list[_TtirOp] = []
    open_regions: list[int] = []
    for line in ttir.splitlines():
        stripped = line.strip()
        if stripped.startswith("}"):
            closed = open_regions.pop()
            if stripped.endswith("{"):  # "} else {", "} do {": the next region of the same operation
                open_regions.append(closed)
            continue
        match = _TTIR_OP.match(line)
        if not match:  # the module, a generic-form operation ("tt.reduce"(...) ({), a block label
            if stripped.endswith("{"):
                open_regions.append(-1)
            continue
        result, name, rest = match.groups()
        body, _, location = rest.rpartition(" loc(")
        body = body or rest
        operands_text, _, result_type = body.rpartition(" : ")
        ops.append(_TtirOp(result, name, _TTIR_VALUE.findall(operands_text or body), result_type.strip(),
                           location.rstrip(")") if location else "", tuple(open_regions)))
        if stripped.endswith("{"):
            open_regions.append(len(ops) - 1)
    return ops, aliases


def _source_line(location: str, aliases: dict[str, str]) -> str:
    """``file.py:line`` of a TTIR location (an alias, a call site: the callee's line, a named location)."""
    for _ in range(64):  # aliases chain a few levels deep
        location = location.strip()
        if location.startswith("#loc"):
            location = aliases.get(location.split(")")[0], "")
        elif location.startswith("callsite("):
            location = location.removeprefix("callsite(").split(" at ")[0]
        elif (found := _TTIR_FILE_LOC.match(location)):
            return f"{found.group(1).rsplit('/', 1)[-1]}:{found.group(2)}"
        elif location.startswith('"') and "(" in location:  # a named location: "name"(#loc3)
            location = location.split("(", 1)[1]
        else:
            return "?"
    return "?"


def _is_int32(result_type: str) -> bool:
    return result_type == "i32" or result_type.endswith("xi32>")


def ttir_hazards(ttir: str) -> dict[str, list[str]]:
    """Two GPU hazards of a kernel, read from its TTIR (the source lines where they are, sorted):

    * ``int32_address_products``: a product of two runtime values (a program id, an index, a stride, a size:
      not a constexpr tile size) computed in 32 bits on the way to a pointer offset. Such a product wraps at
      2^31 (rows x stride at a million tokens, batch x head x N x D), and casting after the product is too late;
      a product with an int64 factor (``.to(tl.int64)``) is computed in 64 bits.
    * ``unsynchronised_rereads``: a load, inside a loop, of a pointer the kernel also stores to, with no
      ``tl.debug_barrier()`` earlier in the loop body: a thread may read an element another thread of the
      program stored in the previous iteration (the layouts of the load and of the store need not match),
      and nothing orders the two.
    """
    ops, aliases = _ttir_ops(ttir)
    definition = {op.result: op for op in ops if op.result}

    def constant(value: str) -> bool:
        op = definition.get(value)
        return op is not None and (op.name == "arith.constant" or
                                   (op.name in _TTIR_CONSTANT_SHAPING and constant(op.operands[0])))

    products: set[str] = set()
    seen: set[str] = set()

    def follow(value: str) -> None:
        if value in seen or (op := definition.get(value)) is None or op.name == "tt.load" or op.name.startswith("scf."):
            return  # arguments, loop variables, loaded data and loop results are where the chain starts
        seen.add(value)
        if op.name == "arith.muli" and _is_int32(op.result_type) and not any(map(constant, op.operands)):
            products.add(_source_line(op.location, aliases))
        for operand in op.operands:
            follow(operand)

    for op in ops:
        if op.name == "tt.addptr":
            follow(op.operands[1])
    stored = {op.operands[0] for op in ops if op.name == "tt.store"}
    rereads: set[str] = set()
    for index, op in enumerate(ops):
        loops = [line for line in op.regions if line >= 0 and ops[line].name in ("scf.for", "scf.while")]
        if op.name != "tt.load" or op.operands[0] not in stored or not loops:
            continue
        if not any(other.name in _TTIR_BARRIERS and loops[-1] in other.regions for other in ops[loops[-1] + 1:index]):
            rereads.add(_source_line(op.location, aliases))
    return {"int32_address_products": sorted(products), "unsynchronised_rereads": sorted(rereads)}


def compile_launch(launch: Launch, arch: int) -> dict[str, Any]:
    """Compile one launch for sm_``arch``: status, shared bytes against the per-block limit, registers,
    spill bytes and seconds (or the compiler's error)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    limit = SHARED_MEMORY_PER_BLOCK[arch]
    begin = time.monotonic()
    log = io.StringIO()
    try:
        target, signature, constexprs, attrs, options = _signature(launch, arch)
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # ptxas's -v report (registers, spills) printed to stdout
            compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 (the compiler's error is the result)
        message = str(exc).strip().splitlines()
        return {"status": "error", "error": f"{type(exc).__name__}: {' '.join(message[:3])}"[:500],
                "seconds": round(time.monotonic() - begin, 2), "shared_limit": limit}
    text = log.getvalue()
    registers = [int(m) for m in _PTXAS_REGISTERS.findall(text)]
    spills = [int(a) + int(b) for a, b in _PTXAS_SPILLS.findall(text)]
    shared = int(compiled.metadata.shared)
    result = {"status": "ok", "seconds": round(time.monotonic() - begin, 2), "shared": shared, "shared_limit": limit,
              "registers": max(registers) if registers else None, "spill_bytes": max(spills) if spills else None,
              "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages}
    result["spills_over_limit"] = (result["spill_bytes"] or 0) > SPILL_LIMIT_BYTES  # slow, not wrong: reported
    result.update(ttir_hazards(compiled.asm["ttir"]))
    if shared > limit:
        result["status"] = "over shared memory"
    return result


def _compile_in_child(launch: Launch, arch: int, cache_dir: str, pipe: Any) -> None:
    from triton import knobs

    knobs.cache.dir = cache_dir
    pipe.send(compile_launch(launch, arch))


def compile_all(jobs: list[tuple[Launch, int]], timeout_s: float, workers: int, cache_dir: str,
                done: Callable[[int, dict[str, Any]], None]) -> None:
    """:func:`compile_launch` of each (launch, arch) in forked children, ``workers`` at a time, each stopped
    after ``timeout_s`` (ptxas can run for minutes); ``done(index, result)`` as each one ends."""
    context = multiprocessing.get_context("fork")
    pending = list(enumerate(jobs))
    running: dict[Any, tuple[int, Any, float]] = {}  # receiving end -> (index, child, start)
    while pending or running:
        while pending and len(running) < workers:
            index, (launch, arch) = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_compile_in_child, args=(launch, arch, cache_dir, send), daemon=True)
            child.start()
            send.close()
            running[receive] = (index, child, time.monotonic())
        first_deadline = min(start for _, _, start in running.values()) + timeout_s
        ready = multiprocessing.connection.wait(list(running), timeout=max(0.0, first_deadline - time.monotonic()))
        for receive in list(running):
            index, child, start = running[receive]
            arch = jobs[index][1]
            if receive in ready:
                try:
                    result = receive.recv()
                except EOFError:
                    child.join()
                    result = {"status": "error", "error": f"the compiling process ended with status {child.exitcode}",
                              "shared_limit": SHARED_MEMORY_PER_BLOCK[arch]}
            elif time.monotonic() - start >= timeout_s:
                child.kill()
                result = {"status": "timeout", "error": f"not compiled in {timeout_s:.0f} s",
                          "seconds": round(time.monotonic() - start, 1), "shared_limit": SHARED_MEMORY_PER_BLOCK[arch]}
            else:
                continue
            child.join()
            receive.close()
            del running[receive]
            done(index, result)


def run_aot(config: AotConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Capture every mechanism's launches in every form of ``config``, compile each distinct one for each
    arch; the report lists one row per (kernel configuration, arch), the forms that reach it, and the
    refused forms."""
    import triton

    begin = time.monotonic()
    names = config.attentions or attention.available()
    rows: list[dict[str, Any]] = []
    refused: list[dict] = []
    captured: list[tuple[Form, Launch]] = []
    owners: dict[int, str] = {}
    for name in names:
        forms = config.forms(causal=attention.capabilities(name).causal)
        launches, refusals = capture_forms(name, forms, config.heads, config.batch)
        refused += refusals
        for _, launch in launches:
            owners.setdefault(id(launch), name)
        captured += launches
    by_key: dict[str, dict[str, Any]] = {}
    for form, launch in captured:
        key = f"{launch.kernel.fn.__module__}.{launch.name}" if config.one_per_kernel else launch_key(launch)
        entry = by_key.setdefault(key, {"launch": launch, "forms": [], "attentions": []})
        if not config.one_per_kernel and _switches_on(launch) > _switches_on(entry["launch"]):
            entry["launch"] = launch
        entry["forms"].append(form.label())
        if owners[id(launch)] not in entry["attentions"]:
            entry["attentions"].append(owners[id(launch)])
    log(f"aot: {len(captured)} launches of {len(names)} mechanisms, {len(by_key)} distinct kernel configurations, "
        f"targets {', '.join(f'sm_{a}' for a in config.archs)} (triton {triton.__version__})")
    entries = [entry for entry in by_key.values() for _ in config.archs]
    jobs = [(entry["launch"], arch) for entry in by_key.values() for arch in config.archs]

    def done(index: int, result: dict[str, Any]) -> None:
        entry, arch = entries[index], jobs[index][1]
        described = _describe(entry["launch"])
        row = {**described, "arch": arch, "attentions": entry["attentions"], "forms": entry["forms"], **result}
        rows.append(row)
        log(f"aot sm_{arch} {described['module']}.{described['kernel']} {'/'.join(described['dtypes'])} "
            f"{described['constexprs']}: {_result_text(row)}")

    with tempfile.TemporaryDirectory(prefix="longattn-aot-") as cache_dir:  # fresh: every compile runs ptxas
        compile_all(jobs, config.timeout_s, config.workers, cache_dir, done)
    failures = [r for r in rows if r["status"] != "ok"]
    return {"config": asdict(config), "triton": triton.__version__, "rows": rows, "refused": refused,
            "outside_device_guard": sorted({f"{launch.kernel.fn.__module__}.{launch.name}" for _, launch in captured
                                            if not _under_its_device(launch)}),
            "failures": len(failures), "over_shared": sum(r["status"] == "over shared memory" for r in rows),
            "spilling": sum(bool(r.get("spills_over_limit")) for r in rows),
            "hazards": sum(bool(r.get("int32_address_products") or r.get("unsynchronised_rereads")) for r in rows),
            "seconds": round(time.monotonic() - begin, 1)}


def _under_its_device(launch: Launch) -> bool:
    """Whether the launch was made under the device of its tensors (triton launches on the current device)."""
    devices = {arg.device for arg in (*launch.args, *launch.kwargs.values()) if isinstance(arg, torch.Tensor)}
    return launch.device is not None and devices <= {launch.device}


def _result_text(row: dict[str, Any]) -> str:
    if row["status"] in ("error", "timeout"):
        return f"{row['status']}: {row['error']}"
    return (f"{row['status']}, shared {row['shared']:,} of {row['shared_limit']:,} B, {row['registers']} registers, "
            f"{row['spill_bytes']} B spilled, {row['seconds']:.1f} s{_hazard_text(row)}")


def _hazard_text(row: dict[str, Any]) -> str:
    """The TTIR hazards of a row (:func:`ttir_hazards`), with their source lines; empty where none."""
    found = [f"{kind.replace('_', ' ')} at {' '.join(row[kind])}" for kind in
             ("int32_address_products", "unsynchronised_rereads") if row.get(kind)]
    return "; " + "; ".join(found) if found else ""


def aot_table(report: dict[str, Any]) -> str:
    """Markdown: one line per (kernel configuration, target), the failures first."""
    from longattn.experiment.results import markdown_table

    rows = sorted(report["rows"], key=lambda r: (r["status"] == "ok", r["module"], r["kernel"], r["arch"]))
    table = markdown_table(
        ["kernel", "dtypes", "constexprs", "target", "status", "shared B", "limit B", "registers", "spill B", "s",
         "mechanisms"],
        [[f"{r['module']}.{r['kernel']}", "/".join(r["dtypes"]),
          " ".join(f"{k}={v}" for k, v in r["constexprs"].items() if v is not None), f"sm_{r['arch']}",
          (r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"[:80]) + _hazard_text(r),
          r.get("shared", "-"),
          r["shared_limit"], r.get("registers", "-"), r.get("spill_bytes", "-"), r.get("seconds", "-"),
          " ".join(r["attentions"])] for r in rows])
    config = report["config"]
    head = (f"# Ahead-of-time compile of the Triton kernels (triton {report['triton']})\n\n"
            f"{len(report['rows'])} (kernel configuration, target) pairs: {report['failures']} not ok, "
            f"{report['over_shared']} over the shared-memory limit, {report['spilling']} spilling more than "
            f"{SPILL_LIMIT_BYTES:,} B, {report['hazards']} with a TTIR hazard (32-bit address products, "
            f"unsynchronised re-reads); {report['seconds']:.0f} s. Forms: dtypes "
            f"{' '.join(config['dtypes'])}, head dims {' '.join(map(str, config['head_dims']))}, lengths "
            f"{' '.join(map(str, config['lengths']))}, batch {config['batch']}, {config['heads']} heads.\n")
    refused = "".join(f"\n- {r['attention']} {r['form']}: {r['error']}" for r in report["refused"])
    if report["outside_device_guard"]:
        head += f"\nLaunched outside their tensors' device (on_device): {' '.join(report['outside_device_guard'])}.\n"
    return head + "\n" + table + ("\n\nForms not run (the mechanism refuses them):" + refused if refused else "")
