"""LRA classifiers: single tower (ListOps, Text, Image, Pathfinder) and dual tower (Retrieval)."""

from __future__ import annotations

import importlib
from typing import Any, Literal

import torch
from torch import Tensor, nn

from longattn.models.encoder import LRAEncoder
from longattn.models.registry import register_model

HEADS = ("mlp", "singular")


def mlp_head(in_dim: int, hidden: int, num_classes: int) -> nn.Sequential:
    """The LRA classifier: Linear -> ReLU -> Linear."""
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def _singular_head(dim: int, num_classes: int) -> nn.Module:
    # Imported lazily: the Singularformer head lives with its mechanism and may not be installed.
    try:
        module = importlib.import_module("longattn.models.singular_head")
    except ImportError as err:
        raise ValueError(
            "head='singular' needs longattn.models.singular_head.SingularHead, which is not available"
        ) from err
    return module.SingularHead(dim, num_classes)


class LRAClassifier(nn.Module):
    """Encoder + pooling + classifier. ``forward(tokens, attention_mask) -> logits [B, classes]``.

    ``head="singular"`` replaces pooling + MLP by the Singularformer head of its Figure 5
    (max + mean pooling then two dense layers), which reads the token features and the mask.
    """

    def __init__(self, encoder: LRAEncoder, num_classes: int, hidden: int = 128, head: str = "mlp") -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.encoder = encoder
        self.head_kind = head
        if head == "singular":
            self.head = _singular_head(encoder.dim, num_classes)
        else:
            self.head = mlp_head(encoder.pooled_dim, hidden, num_classes)

    def forward(self, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        features, mask = self.encoder(tokens, attention_mask)
        if self.head_kind == "singular":
            return self.head(features, mask)
        return self.head(self.encoder.pool(features, mask))


class LRADualClassifier(nn.Module):
    """Two documents through one shared encoder; classify [x0, x1, x0*x1, x0-x1] (LRA Retrieval)."""

    def __init__(self, encoder: LRAEncoder, num_classes: int, hidden: int = 128, head: str = "mlp") -> None:
        super().__init__()
        if head != "mlp":
            raise ValueError(f"the dual-tower (retrieval) model supports head='mlp' only, got {head!r}")
        self.encoder = encoder
        self.head = mlp_head(4 * encoder.pooled_dim, hidden, num_classes)

    def embed(self, tokens: Tensor, attention_mask: Tensor | None) -> Tensor:
        features, mask = self.encoder(tokens, attention_mask)
        return self.encoder.pool(features, mask)

    def forward(
        self,
        tokens0: Tensor,
        attention_mask0: Tensor | None,
        tokens1: Tensor,
        attention_mask1: Tensor | None,
    ) -> Tensor:
        x0 = self.embed(tokens0, attention_mask0)
        x1 = self.embed(tokens1, attention_mask1)
        return self.head(torch.cat([x0, x1, x0 * x1, x0 - x1], dim=-1))


@register_model("lra_classifier", family="classifier")
def build_classifier(
    vocab_size: int,
    num_classes: int,
    max_len: int,
    dual: bool = False,
    attention: str = "softmax",
    attention_options: dict[str, Any] | None = None,
    layers: int = 2,
    dim: int = 64,
    hidden: int = 128,
    heads: int = 2,
    dropout: float = 0.1,
    embedding_dropout: float = 0.1,
    norm: Literal["pre", "post"] = "pre",
    pooling: Literal["mean", "cls", "maxmean"] = "mean",
    head: Literal["mlp", "singular"] = "mlp",
) -> nn.Module:
    """Build the single- or dual-tower LRA model; the keyword names match the config's ``model`` section."""
    encoder = LRAEncoder(
        vocab_size, max_len, attention=attention, attention_options=attention_options, layers=layers,
        dim=dim, hidden=hidden, heads=heads, dropout=dropout, embedding_dropout=embedding_dropout,
        norm=norm, pooling=pooling,
    )
    cls = LRADualClassifier if dual else LRAClassifier
    return cls(encoder, num_classes, hidden=hidden, head=head)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
