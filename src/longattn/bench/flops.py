"""FLOPs of computing attention, analytic and measured (Skeinformer Table 3, Appendix A.4).

Skeinformer's Table 3 gives "the leading terms of FLOPs in computing attention" for sequence length
n, head dimension p and d features (samples, landmarks, projected length, random features; d = 256
in the paper, p = 32), "assuming the matrices Q, K, V are given and omitting the non-leading term".
Its unit is the multiply-add (standard attention is 2 n^2 p: n^2 p for Q K^T and n^2 p for the
weights times V), while torch's FlopCounterMode counts a multiply-add as 2 FLOPs; measured counts
are halved before they are compared.

Every mechanism of the table is written here once, as two formulas in multiply-adds:

* ``paper``: the table's leading term, as printed;
* ``count``: what this library's implementation computes, derived op by op: the table's term plus
  the terms it omits (n-independent ones such as Nystromformer's pseudo-inverse, which at d = 256
  outweighs 4ndp until n is near 10^4) and, where the implementation computes more than the table
  says, the reason (``note``).

The measurement runs one forward pass of the mechanism's layer (one head of width p) under
:func:`longattn.bench.speed.flop_counter` with its Q/K/V/output projections replaced by a stand-in
that hands the input over as Q, K and V: the table assumes Q, K, V given. ``slope`` is the measured growth per token between two lengths,
(F(n2) - F(n1)) / (n2 - n1), the coefficient of the leading term in n whatever the constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from longattn import attention
from longattn.attention.base import merge_heads, split_heads
from longattn.attention.performer import FAVOR_CHUNK, FAVOR_KEEP_ELEMENTS
from longattn.bench.speed import flop_counter

__all__ = ["FLOP_MODELS", "FlopModel", "flop_rows", "flops_table", "measure_attention_macs", "plot_flops"]

# Skeinformer A.4: "we fix p = 32, d = 256"; BigBird with its defaults (block 64, 3 window and 3 random blocks).
PAPER_HEAD_DIM = 32
PAPER_FEATURES = 256
BIGBIRD_BLOCK = 64
BIGBIRD_KEY_BLOCKS = 3 + 3 + 2  # window + random + the two global blocks, per middle query block
# Nystromformer's defaults, passed explicitly so that the count below and the layer agree
NYSTROM_PINV_ITERATIONS = 6
NYSTROM_CONV_KERNEL = 33


def _informer_active(n: int, factor: float) -> int:
    # Informer's u = c * ceil(ln n) (its Section 3.1), clamped to [1, n] as the implementation does
    return max(1, min(n, math.floor(factor * math.ceil(math.log(n)))))


def _informer_factor(n: int, d: int) -> float:
    # Skeinformer A.1: "(256 / log n) as the factor in Informer", so that u = d queries / keys are sampled
    return d / math.ceil(math.log(n)) * (1 + 1e-9)


@dataclass(frozen=True)
class FlopModel:
    """One row of Skeinformer Table 3: the printed term, this implementation's analytic count (both
    in multiply-adds, as functions of n, d, p) and the build options that give it d features."""

    mechanism: str
    paper_term: str
    paper: Callable[[int, int, int], float]
    count: Callable[[int, int, int], float]
    options: Callable[[int, int], dict[str, Any]]
    note: str = ""


def _bigbird_count(n: int, d: int, p: int) -> float:
    # the first and last query blocks attend to all n keys; each of the other n - 2b queries to K b keys;
    # Q K^T and weights x V each. With b = 64, K = 8: 2 (512 + 128) n p = 5 n d p at d = 256, the paper's
    # "640 n elements" visited.
    b = BIGBIRD_BLOCK
    return 2 * p * (2 * b * n + (n - 2 * b) * BIGBIRD_KEY_BLOCKS * b)


def _performer_count(n: int, d: int, p: int) -> float:
    """4ndp + 2nd, plus one more projection of K where the features are recomputed chunk by chunk
    (one sequence, one head: see performer._chunked_favor)."""
    kept = n <= FAVOR_CHUNK and n * d <= FAVOR_KEEP_ELEMENTS
    return 4 * n * d * p + 2 * n * d + (0 if kept else n * d * p)


def _informer_count(n: int, d: int, p: int) -> float:
    # Informer eq. 4: every query against u sampled keys (n u p), then the u active queries attend to
    # all keys (2 u n p); the other queries take the mean of V (no multiply-add).
    u = _informer_active(n, _informer_factor(n, d))
    return 3 * n * u * p


FLOP_MODELS: dict[str, FlopModel] = {m.mechanism: m for m in (
    FlopModel("softmax", "2n^2p", lambda n, d, p: 2 * n * n * p, lambda n, d, p: 2 * n * n * p, lambda n, d: {}),
    FlopModel("bigbird", "5ndp", lambda n, d, p: 5 * n * d * p, _bigbird_count,
              lambda n, d: {"block_size": BIGBIRD_BLOCK, "random_blocks": 3, "window_blocks": 3},
              "the table's d = 256 stands for 640 visited keys per query (2 global + 3 window + 3 random blocks "
              "of 64, and the global rows); the count has no d"),
    FlopModel("performer", "3ndp", lambda n, d, p: 3 * n * d * p,
              _performer_count,
              lambda n, d: {"nb_features": d},
              "FAVOR+ itself is 4ndp (phi(Q), phi(K), phi(K)^T V, phi(Q) (phi(K)^T V)) + 2nd for the normaliser "
              "(the products with a value column of ones); the table's 3ndp leaves one out. The implementation "
              "adds ndp where the features are not kept (above FAVOR_CHUNK tokens): the keys' numerical "
              "stabiliser (their max exponent) projects K once more, in a separate pass so that no [n, d] "
              "feature tensor is kept (the queries' is read off their projections)"),
    FlopModel("nystrom", "4ndp", lambda n, d, p: 4 * n * d * p,
              lambda n, d, p: 4 * n * d * p + 4 * NYSTROM_PINV_ITERATIONS * d**3 + 2 * d * d * p
              + NYSTROM_CONV_KERNEL * n * p,
              lambda n, d: {"num_landmarks": d, "pinv_iterations": NYSTROM_PINV_ITERATIONS,
                            "conv_kernel": NYSTROM_CONV_KERNEL},
              "4ndp (Q against landmark keys, landmark queries against K, both times values) plus what the "
              "table omits: 6 pseudo-inverse iterations of 4 d x d x d products (24 d^3), 2 d^2 p among "
              "landmarks and the kernel-33 depth-wise convolution of V (33 n p)"),
    FlopModel("linformer", "4ndp", lambda n, d, p: 4 * n * d * p, lambda n, d, p: 4 * n * d * p,
              lambda n, d: {"k": d}),
    FlopModel("informer", "3ndp", lambda n, d, p: 3 * n * d * p, _informer_count,
              lambda n, d: {"factor": _informer_factor(n, d)},
              "u = factor * ceil(ln n) with factor = d / ceil(ln n): u = d"),
    FlopModel("skein", "4ndp", lambda n, d, p: 4 * n * d * p, lambda n, d, p: 4 * n * d * p,
              lambda n, d: {"samples": d},
              "pilot rows against K and times V, all queries against the d sampled columns and times their V"),
)}


class _GivenQKV(nn.Module):
    """Stands in for a layer's QKVProjection so that Q, K, V are given (Table 3's assumption): the
    input split into heads is the queries, keys and values, and the output is the heads merged;
    no projection is computed. Like ``longattn.hf``'s stand-in, it is not a QKVProjection, so layers
    that fold their projections into chunks take their path for handed-over q, k, v."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_out = nn.Identity()

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        heads = split_heads(x, self.heads)
        return heads, heads, heads

    def out(self, heads_out: Tensor) -> Tensor:
        return merge_heads(heads_out)


def measure_attention_macs(mechanism: str, n: int, d: int = PAPER_FEATURES, p: int = PAPER_HEAD_DIM,
                           seed: int = 0) -> int:
    """Multiply-adds of one forward pass of ``mechanism`` on one sequence of n tokens, one head of
    width p, with Q, K, V given (projections not counted), as torch's counter measures them."""
    if mechanism not in FLOP_MODELS:
        raise ValueError(f"no FLOP model for {mechanism!r}; Skeinformer Table 3 has {', '.join(FLOP_MODELS)}")
    torch.manual_seed(seed)
    layer = attention.build(mechanism, dim=p, heads=1, max_len=n, **FLOP_MODELS[mechanism].options(n, d)).eval()
    layer.proj = _GivenQKV(heads=1)
    x = torch.randn(1, n, p)
    with torch.no_grad(), flop_counter() as counter:
        layer(x)
    return counter.get_total_flops() // 2  # torch counts a multiply-add as 2 FLOPs; Table 3 as one


def flop_rows(mechanisms: list[str], lengths: list[int], d: int = PAPER_FEATURES, p: int = PAPER_HEAD_DIM,
              seed: int = 0) -> list[dict[str, Any]]:
    """Measured and analytic multiply-adds per mechanism and length, their ratios, and the measured
    slope per token against the paper's leading coefficient (from the previous length)."""
    rows = []
    for mechanism in mechanisms:
        model = FLOP_MODELS.get(mechanism)
        if model is None:
            raise ValueError(f"no FLOP model for {mechanism!r}; Skeinformer Table 3 has {', '.join(FLOP_MODELS)}")
        previous = None
        for n in sorted(lengths):
            measured = measure_attention_macs(mechanism, n, d, p, seed)
            count, paper = model.count(n, d, p), model.paper(n, d, p)
            row = {"mechanism": mechanism, "n": n, "d": d, "p": p, "paper_term": model.paper_term,
                   "measured_macs": measured, "analytic_macs": count, "paper_macs": paper,
                   "measured_over_analytic": measured / count, "measured_over_paper": measured / paper,
                   "slope_over_paper": None, "note": model.note}
            if previous is not None:
                slope = (measured - previous[1]) / (n - previous[0])
                paper_slope = (paper - model.paper(previous[0], d, p)) / (n - previous[0])
                row["slope_over_paper"] = slope / paper_slope
            previous = (n, measured)
            rows.append(row)
    return rows


def flops_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per mechanism and n, the paper's term, the analytic count, the measured count
    (all in multiply-adds) and their ratios."""
    lines = ["Multiply-adds of one forward pass, Q, K, V given (Skeinformer Table 3's unit); "
             f"d = {rows[0]['d'] if rows else PAPER_FEATURES}, p = {rows[0]['p'] if rows else PAPER_HEAD_DIM}.",
             "", "| mechanism | Table 3 | n | measured MMAC | analytic MMAC | measured / analytic | "
             "Table 3 MMAC | measured / Table 3 | slope / Table 3 slope |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        slope = "-" if r["slope_over_paper"] is None else f"{r['slope_over_paper']:.3f}"
        lines.append(f"| {r['mechanism']} | {r['paper_term']} | {r['n']} | {r['measured_macs'] / 1e6:.1f} | "
                     f"{r['analytic_macs'] / 1e6:.1f} | {r['measured_over_analytic']:.3f} | {r['paper_macs'] / 1e6:.1f} | "
                     f"{r['measured_over_paper']:.3f} | {slope} |")
    notes = {r["mechanism"]: r["note"] for r in rows if r["note"]}
    if notes:
        lines += ["", "Analytic count against Table 3:", ""] + [f"* {m}: {note}." for m, note in notes.items()]
    return "\n".join(lines)


def plot_flops(rows: list[dict[str, Any]], path: str) -> None:
    """Measured multiply-adds against n (points) with the analytic count (line) per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for mechanism in dict.fromkeys(r["mechanism"] for r in rows):
        mine = sorted((r for r in rows if r["mechanism"] == mechanism), key=lambda r: r["n"])
        line, = ax.plot([r["n"] for r in mine], [r["analytic_macs"] for r in mine], lw=1)
        ax.plot([r["n"] for r in mine], [r["measured_macs"] for r in mine], "o", color=line.get_color(),
                label=f"{mechanism} ({mine[0]['paper_term']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("multiply-adds (points: measured, lines: analytic)")
    ax.set_title("Attention FLOPs, Q, K, V given (Skeinformer Table 3)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
