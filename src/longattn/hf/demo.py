"""Every mechanism inside the pretrained MiniLM-L6, and a short fine-tuning of converted models.

``python -m longattn.hf.demo table --data DIR`` prints, for every registered mechanism, the cosine of
the mean-pooled MiniLM embedding of real sentences to the original model's, and the path it takes
(register or convert); ``--mechanisms skeleton skeleton:smoother=false,s1=128`` names mechanisms with
options (ablations of one mechanism side by side); ``python -m longattn.hf.demo finetune --data DIR``
fine-tunes converted MiniLMs on SST-2 (``DIR/train.tsv``: ``sentence<TAB>label``) and reports the loss
before and after, the dev accuracy, and the gradient norms of new and pretrained parameters after the
first step.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from longattn.attention import AttentionError, available, capabilities, collect_aux_losses, get_spec
from longattn.config import ConfigError, parse_value
from longattn.hf.bridge import ModelProjections, attention_modules, enable, function_path_names, unregister
from longattn.hf.convert import NO_QKV_MAPPING, convert
from longattn.hf.minilm import load_bert, minilm_path

__all__ = ["embedding_table", "finetune", "mean_pool", "parse_variant", "read_sst2"]


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """The sentence embedding of all-MiniLM-L6-v2: the mean of the real tokens' hidden states."""
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def read_sst2(path: str | Path, limit: int | None = None) -> tuple[list[str], list[int]]:
    """Sentences and labels of a GLUE SST-2 split (``sentence<TAB>label`` with a header line)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"SST-2 file {file} not found (GLUE SST-2 train.tsv / dev.tsv)")
    sentences, labels = [], []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines()[1:], start=2):
        parts = line.rsplit("\t", 1)
        if len(parts) != 2 or parts[1].strip() not in ("0", "1"):
            raise ValueError(f"{file}:{number}: expected 'sentence<TAB>0|1', got {line[:60]!r}")
        sentences.append(parts[0].strip())
        labels.append(int(parts[1]))
        if limit is not None and len(sentences) >= limit:
            break
    return sentences, labels


def _tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)


def with_mechanism(name: str, *, seed: int = 0, max_len: int = 128, **options: Any) -> tuple[nn.Module, str]:
    """MiniLM with ``name``: through register() when it has a function form, else convert(); and the path."""
    model = load_bert()
    if name in function_path_names():
        unregister(name)
        return enable(model, name, seed=seed, ignore_dropout=True, **options), "function (register)"
    fresh = name in NO_QKV_MAPPING
    convert(model, name, max_len=max_len if capabilities(name).needs_max_len else None, fresh=fresh, seed=seed,
            ignore_dropout=True, **options)
    return model, "convert, fresh projections" if fresh else "convert"


def _convert_path(model: nn.Module) -> str:
    mechanism = attention_modules(model)[0][1].longattn
    projections = getattr(mechanism, "proj", None)
    if isinstance(projections, ModelProjections) and not projections.reads_hidden_states:
        return "model's q, k, v"
    return "hidden states, pretrained Q/K/V"


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``"skeleton:smoother=false,s1=128"`` -> ``("skeleton", {"smoother": False, "s1": 128})``; values as
    ``--set`` reads them."""
    name, _, listed = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, listed.split(",")):
        key, equals, raw = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"mechanism {text!r}: {item!r} must look like option=value "
                              "(e.g. skeleton:smoother=false,s1=128)")
        options[key.strip()] = parse_value(raw)
    return name.strip(), options


def _checked_variants(labels: list[str], seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, name, options) per variant, every name and option checked before MiniLM loads. ``seed=`` and
    ``max_len=`` in a variant are :func:`with_mechanism`'s (the bridge's layer seed, which also draws BigBird's
    pattern; the length a fixed-length map is built for); ``seed`` defaults to the table's."""
    variants = []
    for label in labels:
        name, options = parse_variant(label)
        valid = (*get_spec(name).option_names, "seed", "max_len")  # an unknown name lists the registered ones
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise AttentionError(f"unknown option(s) {unknown} for attention {name!r} in {label!r}; valid options: "
                                 f"{', '.join(valid)}")
        variants.append((label, name, {"seed": seed, **options}))
    return variants


@torch.no_grad()
def embedding_table(sentences: list[str], names: list[str] | None = None, batch_size: int = 32,
                    seed: int = 0) -> list[dict[str, Any]]:
    """Mean-pooled embedding cosine to the original MiniLM for each mechanism (a name, or a name with options:
    :func:`parse_variant`), with the path it used."""
    variants = _checked_variants(names or available(), seed)
    tokenizer = _tokenizer()
    batches = [tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=128,
                         return_tensors="pt") for i in range(0, len(sentences), batch_size)]
    reference = load_bert()
    originals = [mean_pool(reference(**b).last_hidden_state, b["attention_mask"]) for b in batches]
    rows = []
    for label, name, options in variants:
        torch.manual_seed(options["seed"])  # stochastic mechanisms (skein, informer, ...) draw from the global RNG
        model, path = with_mechanism(name, **options)
        cosines = torch.cat([
            torch.cosine_similarity(mean_pool(model(**b).last_hidden_state, b["attention_mask"]), e)
            for b, e in zip(batches, originals)
        ])
        if path == "convert":
            path = f"{path}: {_convert_path(model)}"
        rows.append({"mechanism": label, "path": path, "cosine_mean": cosines.mean().item(),
                     "cosine_min": cosines.min().item(), "stochastic": capabilities(name).stochastic_eval})
    return rows


def table_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| mechanism | path | embedding cosine, mean | min |", "|---|---|---|---|"]
    for r in rows:
        star = " (stochastic)" if r["stochastic"] else ""
        lines.append(f"| `{r['mechanism']}`{star} | {r['path']} | {r['cosine_mean']:.4f} | {r['cosine_min']:.4f} |")
    return "\n".join(lines)


class SentenceClassifier(nn.Module):
    """A MiniLM (converted or not) with a linear head on its mean-pooled embedding."""

    def __init__(self, encoder: nn.Module, classes: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.head(mean_pool(hidden, attention_mask))


def _grad_norm(parameters: list[nn.Parameter]) -> float:
    grads = [p.grad.norm() ** 2 for p in parameters if p.grad is not None]
    return math.sqrt(float(sum(grads))) if grads else 0.0


def finetune(name: str, sentences: list[str], labels: list[int], *, steps: int = 300, batch_size: int = 16,
             lr: float = 3e-5, new_lr: float = 1e-3, seed: int = 0, dev: tuple[list[str], list[int]] | None = None,
             **options: Any) -> dict[str, Any]:
    """Fine-tune MiniLM with ``name`` (register or convert, as :func:`with_mechanism`) plus a linear head.

    Pretrained weights train at ``lr``, the new parameters (``.longattn.`` and the head) at ``new_lr``.
    Returns the first and last loss windows, the gradient norms of both groups after the first step and,
    with ``dev``, the accuracy before and after.
    """
    torch.manual_seed(seed)
    encoder, path = with_mechanism(name, seed=seed, **options)
    model = SentenceClassifier(encoder).train()
    new = [p for n, p in model.named_parameters() if ".longattn." in n or n.startswith("head.")]
    pretrained = [p for n, p in model.named_parameters() if not (".longattn." in n or n.startswith("head."))]
    optimizer = torch.optim.AdamW([{"params": pretrained, "lr": lr}, {"params": new, "lr": new_lr}])
    tokenizer = _tokenizer()
    generator = torch.Generator().manual_seed(seed)
    accuracy_before = _accuracy(model, tokenizer, dev) if dev else None
    losses, grads, started = [], {}, time.perf_counter()
    for step in range(steps):
        index = torch.randint(len(sentences), (batch_size,), generator=generator).tolist()
        batch = tokenizer([sentences[i] for i in index], padding=True, truncation=True, max_length=64,
                          return_tensors="pt")
        target = torch.tensor([labels[i] for i in index])
        loss = nn.functional.cross_entropy(model(**batch), target)
        loss = loss + sum(collect_aux_losses(model).values())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = {"pretrained": _grad_norm(pretrained), "new_attention": _grad_norm(
                [p for n, p in model.named_parameters() if ".longattn." in n])}
        optimizer.step()
        losses.append(loss.item())
    window = max(1, min(50, steps // 4))
    return {
        "mechanism": name, "path": path, "steps": steps, "batch_size": batch_size,
        "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window, "window": window,
        "grad_norm_step1": grads, "accuracy_before": accuracy_before,
        "accuracy_after": _accuracy(model, tokenizer, dev) if dev else None,
        "seconds": time.perf_counter() - started, "losses": losses,
    }


@torch.no_grad()
def _accuracy(model: nn.Module, tokenizer: Any, data: tuple[list[str], list[int]]) -> float:
    was_training = model.training
    model.eval()
    sentences, labels = data
    correct = 0
    for i in range(0, len(sentences), 64):
        batch = tokenizer(sentences[i:i + 64], padding=True, truncation=True, max_length=64, return_tensors="pt")
        correct += (model(**batch).argmax(-1) == torch.tensor(labels[i:i + 64])).sum().item()
    model.train(was_training)
    return correct / len(sentences)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longattn.hf.demo", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["table", "finetune"])
    parser.add_argument("--data", required=True, help="GLUE SST-2 folder (train.tsv, dev.tsv)")
    parser.add_argument("--sentences", type=int, default=128, help="dev sentences for the table")
    parser.add_argument("--mechanisms", nargs="*", default=None,
                        help="names, or names with options for the table (skeleton:smoother=false,s1=128)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "table":
        sentences, _ = read_sst2(Path(args.data) / "dev.tsv", limit=args.sentences)
        try:
            result: Any = embedding_table(sentences, args.mechanisms)
        except (ConfigError, AttentionError) as err:
            parser.error(str(err))
        print(table_markdown(result))
    else:
        train = read_sst2(Path(args.data) / "train.tsv")
        dev = read_sst2(Path(args.data) / "dev.tsv")
        result = []
        for name, options in (("skeleton", {"s1": 16, "s2": 16, "max_len": 64}), ("nystrom", {"num_landmarks": 8})):
            if args.mechanisms and name not in args.mechanisms:
                continue
            run = finetune(name, *train, steps=args.steps, dev=dev, **options)
            result.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "losses"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
