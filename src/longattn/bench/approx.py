"""How well each sub-quadratic method approximates exact attention (Skeinformer, section 5, Fig. 1).

Real queries, keys and values come from every layer and head of a pretrained transformer
(MiniLM-L6, transformers' ``BertModel``) run on WikiText-2 text cut into 512-token sequences, or from the same model with
random weights. For each method and sample size d, the error is the relative spectral norm

    || softmax(Q K^T / sqrt(p)) V - R ||_2 / || softmax(Q K^T / sqrt(p)) V ||_2

averaged over sequences, layers, heads and random trials, with its standard error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from longattn.attention.softmax import softmax_attention_reference

# An approximation method: (q, k, v, d, generator) -> approximation of softmax(qk^T/sqrt(p)) v,
# all [H, N, Dh] (one sequence, every head).
ApproxMethod = Callable[[Tensor, Tensor, Tensor, int, torch.Generator], Tensor]

APPROX_METHODS: dict[str, ApproxMethod] = {}


def approx_method(name: str) -> Callable[[ApproxMethod], ApproxMethod]:
    def decorator(fn: ApproxMethod) -> ApproxMethod:
        APPROX_METHODS[name] = fn
        return fn

    return decorator


@approx_method("vmean")
def _vmean(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    # the rank-one baseline 1/n 1 1^T V: every row is the mean of V
    return v.mean(dim=-2, keepdim=True).expand_as(v)


def _skein(**options):
    from longattn.attention.skein import skein_attention

    def method(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
        return skein_attention(q[None], k[None], v[None], samples=d, generator=g, **options)[0]

    return method


# Skeinformer and the ablations of its Table 1 / Fig. 1
APPROX_METHODS["skein"] = _skein()
APPROX_METHODS["skein_uniform"] = _skein(column_sampling="uniform")
APPROX_METHODS["skein_simple_norm"] = _skein(row_normalization="simple")
APPROX_METHODS["skein_no_norm"] = _skein(row_normalization="none")
APPROX_METHODS["skein_no_pilot_reuse"] = _skein(pilot_reuse=False)


@approx_method("skeleton_row")
def _skeleton_row(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    # SKTformer's row branch before its LayerNorm: softmax(Q (P1 K)^T / sqrt(p)) P1 V with d
    # uniformly sampled token positions (section 3.1); the LayerNorm and the 1/2 only rescale.
    idx = torch.randperm(k.shape[-2], generator=g)[:d]
    scores = q @ k[..., idx, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v[..., idx, :]


def _gaussian_sketch(n: int, d: int, g: torch.Generator, like: Tensor) -> Tensor:
    # S in R^{n x d}, i.i.d. N(0, 1/d): E[S S^T] = I (the Johnson-Lindenstrauss sketch)
    return torch.randn(n, d, generator=g, dtype=like.dtype) / math.sqrt(d)


@approx_method("informer")
def _informer(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    from longattn.attention.informer import probsparse_attention, sample_informer_keys

    # u = c * ceil(ln n) queries and keys: choose c so that u = d, as Skeinformer's comparison does
    n = k.shape[-2]
    factor = d / math.ceil(math.log(n))
    keys = sample_informer_keys(None, 1, n, factor, q.device, generator=g)
    return probsparse_attention(q[None], k[None], v[None], factor=factor, key_samples=keys)[0]


@approx_method("linformer")
def _linformer(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    # untrained Linformer: E = F = S^T, a JL sketch of the keys and values along the sequence
    from longattn.attention.linformer import linformer_attention

    sketch = _gaussian_sketch(k.shape[-2], d, g, v)
    return linformer_attention(q[None], k[None], v[None], proj_k=sketch, proj_v=sketch)[0]


@approx_method("linformer_jl")
def _linformer_jl(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    from longattn.attention.linformer import linformer_jl_attention

    return linformer_jl_attention(q[None], k[None], v[None], sketch=_gaussian_sketch(k.shape[-2], d, g, v))[0]


@approx_method("nystrom")
def _nystrom(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    from longattn.attention.nystrom import nystrom_attention

    return nystrom_attention(q[None], k[None], v[None], num_landmarks=min(d, k.shape[-2]))[0]


@approx_method("performer")
def _performer(q: Tensor, k: Tensor, v: Tensor, d: int, g: torch.Generator) -> Tensor:
    from longattn.attention.performer import orthogonal_random_features, performer_attention

    projection = orthogonal_random_features(d, q.shape[-1], generator=g, dtype=q.dtype)
    return performer_attention(q[None], k[None], v[None], projection=projection)[0]


@dataclass
class ApproxResult:
    method: str
    samples: int
    mean: float
    stderr: float
    count: int


def relative_spectral_error(exact: Tensor, approx: Tensor) -> Tensor:
    """||exact - approx||_2 / ||exact||_2 per leading index (matrix 2-norm of the last two dims)."""
    num = torch.linalg.matrix_norm((exact - approx).double(), ord=2)
    return num / torch.linalg.matrix_norm(exact.double(), ord=2)


def wikitext_sequences(data_dir: str | Path, tokenizer, length: int = 512, count: int = 8,
                       split: str = "valid") -> Tensor:
    """Token ids [count, length]: WikiText-2 ``split`` tokenised and cut into consecutive
    sequences of ``length`` tokens, each framed by [CLS] ... [SEP]."""
    file = Path(data_dir) / f"wiki.{split}.tokens"
    if not file.is_file():
        raise FileNotFoundError(
            f"WikiText-2 file {file} not found; pass --data-dir to a folder with wiki.{{train,valid,test}}.tokens"
        )
    tokenizer.no_padding()
    tokenizer.no_truncation()
    text = file.read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    body = length - 2
    if len(ids) < body * count:
        raise ValueError(f"{file} has {len(ids)} tokens, fewer than {count} sequences of {length}")
    rows = [[cls] + ids[i * body:(i + 1) * body] + [sep] for i in range(count)]
    return torch.tensor(rows)


def qkv_per_layer(model, input_ids: Tensor) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """(layer index, q, k, v) with q, k, v of shape [B, H, N, Dh] for every self-attention layer of a
    transformers model (BERT family: the outputs of each layer's query/key/value projections)."""
    from longattn.attention.base import split_heads
    from longattn.hf import attention_modules

    layers = attention_modules(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no self-attention layer with query/key/value projections")
    captured: dict[tuple[int, str], Tensor] = {}
    hooks = []
    for index, (_, module, family) in enumerate(layers):
        heads = module.num_attention_heads if family == "bert" else module.config.num_attention_heads
        for role, attribute in zip("qkv", ("query", "key", "value") if family == "bert" else ("q_proj", "k_proj", "v_proj")):
            def keep(mod, args, out, index=index, role=role, heads=heads):
                captured[(index, role)] = split_heads(out, heads)

            hooks.append(getattr(module, attribute).register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    for index in range(len(layers)):
        yield index, captured[(index, "q")], captured[(index, "k")], captured[(index, "v")]


def evaluate(
    qkv: Iterator[tuple[int, Tensor, Tensor, Tensor]],
    methods: list[str],
    sample_sizes: list[int],
    trials: int = 5,
    seed: int = 0,
    progress: bool = False,
) -> list[ApproxResult]:
    """Mean relative spectral error (and standard error) of each method at each sample size."""
    unknown = [m for m in methods if m not in APPROX_METHODS]
    if unknown:
        raise ValueError(f"unknown approximation method(s) {unknown}; choose from {sorted(APPROX_METHODS)}")
    errors: dict[tuple[str, int], list[Tensor]] = {(m, d): [] for m in methods for d in sample_sizes}
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    for _, q, k, v in tqdm(qkv, desc="approx (layers)", disable=not progress):
        for b in range(q.shape[0]):
            qb, kb, vb = q[b].double(), k[b].double(), v[b].double()
            exact = softmax_attention_reference(qb[None], kb[None], vb[None])[0]
            for method in methods:
                fn = APPROX_METHODS[method]
                for d in sample_sizes:
                    for _ in range(trials):
                        errors[(method, d)].append(relative_spectral_error(exact, fn(qb, kb, vb, d, generator)))
    results = []
    for (method, d), values in errors.items():
        flat = torch.cat([e.flatten() for e in values])
        stderr = flat.std().item() / math.sqrt(flat.numel()) if flat.numel() > 1 else float("nan")
        results.append(ApproxResult(method, d, flat.mean().item(), stderr, flat.numel()))
    return results


def approx_table(results: list[ApproxResult]) -> str:
    sizes = sorted({r.samples for r in results})
    by = {(r.method, r.samples): r for r in results}
    lines = ["| method | " + " | ".join(f"d={d}" for d in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for method in dict.fromkeys(r.method for r in results):
        cells = [f"{by[(method, d)].mean:.4f} ± {by[(method, d)].stderr:.4f}" for d in sizes]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_approx(results: list[ApproxResult], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method in dict.fromkeys(r.method for r in results):
        pts = sorted((r.samples, r.mean, r.stderr) for r in results if r.method == method)
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=2, label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sample size d")
    ax.set_ylabel("relative spectral-norm error")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_as_dicts(results: list[ApproxResult]) -> list[dict[str, Any]]:
    return [r.__dict__ for r in results]
