"""``longattn demo``: run every registered mechanism on generated data and print a table."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from longattn.commands import VERB_HELP
from longattn.commands._args import add_attentions_argument

# torch and the mechanisms are imported by the functions that run them, not here: `longattn demo --help` answers
# without them (tests/commands/test_cli_startup.py).


def run_demo(names: list[str], length: int, dim: int, heads: int, batch: int, seed: int) -> list[dict]:
    """Forward + backward of each mechanism once (after a warm-up) on random data."""
    import torch

    from longattn import attention
    from longattn.utils import seed_everything

    rows = []
    for name in names:
        seed_everything(seed)
        layer = attention.build(name, dim=dim, heads=heads, max_len=length)
        x = torch.randn(batch, length, dim, requires_grad=True)
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[0, length - length // 4 :] = False  # one padded sequence shows masking works
        layer(x, mask).sum().backward()  # warm-up
        start = time.perf_counter()
        out = layer(x, mask)
        out.sum().backward()
        elapsed = time.perf_counter() - start
        rows.append(
            {
                "attention": name,
                "output_shape": list(out.shape),
                "parameters": sum(p.numel() for p in layer.parameters()),
                "fwd_bwd_ms": round(1000 * elapsed, 2),
                "finite": bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all()),
                **{k: v for k, v in layer.capabilities.as_dict().items() if v not in (False, None)},
            }
        )
    return rows


def clock_label(threads: int | None = None) -> str:
    """What the ms column is: wall time of one call, at this process's torch thread count."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    return (f"fwd_bwd_ms: wall time of one forward + backward after a warm-up, {threads} torch "
            f"thread{'s' if threads != 1 else ''} on the CPU (OMP_NUM_THREADS sets them); one call on random data, "
            "not a benchmark: `longattn bench speed` measures cost")


def format_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("-|-".join("-" * widths[c] for c in columns))
    lines += [" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    from longattn import attention
    from longattn.experiment.results import write_results

    names = args.attentions or attention.available()
    rows = run_demo(names, args.length, args.dim, args.heads, args.batch, args.seed)
    print(format_table(rows, ["attention", "output_shape", "parameters", "fwd_bwd_ms", "finite"]))
    print(clock_label())
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_results(Path(args.out) / "demo.json", {"rows": rows})
    return 0 if all(r["finite"] for r in rows) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help=VERB_HELP["demo"],
                              description="Forward and backward of each mechanism once (after a "
                              "warm-up) on random data with one padded sequence; prints a table.")
    add_attentions_argument(p, help="mechanisms (default: all registered)")
    p.add_argument("--length", type=int, default=1023, help="sequence length N")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--out", help="folder for demo.json (default: none written)")
    p.set_defaults(func=_cmd)
