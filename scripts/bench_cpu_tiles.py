"""The two CPU-path choices of docs/performance.md, "GLA and DSA at MQAR's lengths", measured side by side.

    OMP_NUM_THREADS=1 python scripts/bench_cpu_tiles.py [--repeats 3] [--json out.json]

1. GLA's secondary chunking (``gated_scan.CPU_SUB_CHUNK``): one forward and backward of the chunked scan at
   sub-chunks of 4, 8 and 16 tokens (fla's 16 is the CUDA size).
2. DSA's selected attention on the CPU path: the "gather" and "masked" strategies of
   ``token_select.selected_attention``, forward and backward, over keys/top_k pairs on both sides of
   ``token_select.MASKED_UP_TO``, non-causal and causal, and which one the default picks.

Figures are the median process CPU time (user + system) of ``--repeats`` runs after one warm-up, in seconds:
with one thread, CPU time does not grow when another job shares the machine the way wall time does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from longattn.attention.ops import gated_scan, token_select
from longattn.attention.ops.gated_scan import gated_scan_chunked

GLA_SHAPES = [(64, 64), (64, 128), (64, 256), (4, 4096)]  # (batch, length); 2 heads of 64: MQAR's model
DSA_SHAPES = [(256, 64), (1024, 64), (1024, 256), (4096, 256), (4096, 1024), (16384, 512)]


def cpu_seconds(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: allocator and first-call costs
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times)


def gla_case(batch: int, length: int, sub_chunk: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 2, length, 64, generator=g).requires_grad_() for _ in range(3))
    log_decay = (torch.nn.functional.logsigmoid(torch.randn(batch, 2, length, 64, generator=g)) / 16).requires_grad_()

    def run() -> None:
        out, _ = gated_scan_chunked(q, k, v, log_decay)
        out.sum().backward()

    previous = gated_scan.CPU_SUB_CHUNK
    gated_scan.CPU_SUB_CHUNK = sub_chunk
    try:
        return cpu_seconds(run, repeats)
    finally:
        gated_scan.CPU_SUB_CHUNK = previous


def dsa_case(keys: int, top_k: int, causal: bool, strategy: str, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, keys, 64, generator=g).requires_grad_() for _ in range(3))
    index = (torch.randn(1, 2, keys, 16, generator=g), torch.randn(1, keys, 16, generator=g),
             torch.rand(1, 2, keys, generator=g))
    indices, selected = token_select.select_top_k(*index, torch.ones(1, keys, dtype=torch.bool), top_k, causal)

    def run() -> None:
        token_select.selected_attention(q, k, v, indices, selected, 0.125, causal=causal, strategy=strategy).sum().backward()

    return cpu_seconds(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median process CPU s of "
          f"{args.repeats} forward+backward runs")
    results: dict[str, list[dict]] = {"gla": [], "dsa": []}

    print("\nGLA chunked scan, 2 heads of 64, chunk 64: CPU s by sub-chunk")
    print("| batch | length | sub 4 | sub 8 | sub 16 |\n|---|---|---|---|---|")
    for batch, length in GLA_SHAPES:
        row = {f"sub_{s}": gla_case(batch, length, s, args.repeats) for s in (4, 8, 16)}
        results["gla"].append({"batch": batch, "length": length, **row})
        print(f"| {batch} | {length} | " + " | ".join(f"{row[f'sub_{s}']:.3f}" for s in (4, 8, 16)) + " |")

    print(f"\nDSA selected attention, 1 x 4 heads of 64: CPU s by strategy (MASKED_UP_TO = {token_select.MASKED_UP_TO})")
    print("| keys | top_k | causal | gather | masked | default picks |\n|---|---|---|---|---|---|")
    for keys, top_k in DSA_SHAPES:
        for causal in (False, True):
            row = {s: dsa_case(keys, top_k, causal, s, args.repeats) for s in token_select.SELECTION_STRATEGIES}
            picked = token_select.selection_strategy(torch.empty(0), keys, top_k, causal)
            results["dsa"].append({"keys": keys, "top_k": top_k, "causal": causal, **row, "default": picked})
            print(f"| {keys} | {top_k} | {causal} | {row['gather']:.3f} | {row['masked']:.3f} | {picked} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
