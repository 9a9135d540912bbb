"""Zoology's associative-recall language model (Arora et al. 2023) with any registered attention mechanism.

Token embedding + learned positions, ``layers`` pre-LN residual blocks (the mechanism, then an MLP of width
``hidden``; ``hidden=0`` leaves the MLP out), a final LayerNorm and a language-model head tied to the token
embedding. Logits are computed only where they are scored (the query positions of MQAR): a full-vocabulary
output at every position would cost ``seq_len / num_queries`` times more and be thrown away.

Two details of Zoology's code (``zoology/model.py``) are options:

* ``identity_state_mixer``: Zoology's Figure 2 configs have no MLP, but their block still runs its state
  mixer, the identity, on the LayerNorm'd stream and the next residual adds its output, so every block adds
  ``LN(x)`` to the stream after the mechanism (``x + mixer(LN1(x))``, then ``+ LN2(.)``). ``False`` gives
  attention-only blocks. Only for ``hidden=0`` (with an MLP the two wirings are the same).
* ``init="zoology"``: every linear layer and embedding drawn from N(0, 0.02), biases 0, and each block's
  output projection (a mechanism's ``to_out``, an MLP's last layer) from N(0, 0.02 / sqrt(2 * layers)),
  GPT-2's scaled residual initialisation. ``"torch"`` keeps PyTorch's and each mechanism's own.

``causal=None`` (the default) runs a mechanism causally when it has a causal form (next-token prediction,
as in Zoology) and bidirectionally otherwise (token classification at the query positions); ``True`` or
``False`` forces one form (a mechanism without a causal form then refuses ``True``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from longattn import attention as attention_registry
from longattn.models.encoder import EncoderBlock, check_index_ranges
from longattn.models.registry import register_model

__all__ = ["INITS", "RecallModel", "resolve_causal"]

INITS = ("zoology", "torch")
INIT_STD = 0.02  # Zoology's initializer_range


def resolve_causal(attention: str, causal: bool | None) -> bool:
    """The form a mechanism runs in: ``causal`` if given, else causal exactly when the mechanism can be."""
    return attention_registry.capabilities(attention).causal if causal is None else bool(causal)


@register_model("zoology", family="recall", description="Zoology's MQAR model: embedding, attention blocks, "
                "tied head at the query positions")
class RecallModel(nn.Module):
    """``forward(tokens [B, N], query_positions [B, K]) -> logits [B, K, vocab_size]``."""

    def __init__(self, vocab_size: int, max_len: int, attention: str = "softmax",
                 attention_options: dict[str, Any] | None = None, causal: bool | None = None, layers: int = 2,
                 dim: int = 64, heads: int = 1, hidden: int = 0, dropout: float = 0.0,
                 embedding_dropout: float = 0.1, tie_embeddings: bool = True, identity_state_mixer: bool = False,
                 init: str = "torch") -> None:
        super().__init__()
        if vocab_size <= 0 or max_len <= 0 or dim <= 0 or layers <= 0:
            raise ValueError(f"vocab_size, max_len, dim and layers must be positive, got {vocab_size}, {max_len}, "
                             f"{dim}, {layers}")
        if hidden < 0:
            raise ValueError(f"hidden must be >= 0 (0: no MLP), got {hidden}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        self.vocab_size, self.max_len, self.dim = vocab_size, max_len, dim
        self.causal = resolve_causal(attention, causal)
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_len, dim)
        self.embedding_dropout = nn.Dropout(embedding_dropout)
        options = dict(attention_options or {})
        self.blocks = nn.ModuleList(
            EncoderBlock(attention_registry.build(attention, dim=dim, heads=heads, max_len=max_len,
                                                  causal=self.causal, **options), dim, hidden, dropout, "pre")
            for _ in range(layers))
        # Zoology's block without an MLP: the identity state mixer's input, LN2(x), joins the stream.
        self.state_norms = (nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
                            if identity_state_mixer and hidden == 0 else None)
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if init == "zoology":
            self._zoology_init(layers)
        else:  # the embeddings are Zoology's either way (PyTorch's N(0, 1) would swamp the positions' signal)
            nn.init.normal_(self.token_embedding.weight, std=INIT_STD)
            nn.init.normal_(self.position_embedding.weight, std=INIT_STD)
        if tie_embeddings:
            self.head.weight = self.token_embedding.weight

    def _zoology_init(self, layers: int) -> None:
        """``zoology.model._init_weights``: N(0, 0.02) everywhere, the residual branches' last layers scaled."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            last = [module for name, module in block.attention.named_modules() if name.rsplit(".", 1)[-1] == "to_out"]
            last += [block.ffn[-1]] if block.ffn is not None else []
            for linear in last:
                nn.init.normal_(linear.weight, std=INIT_STD / math.sqrt(2 * layers))

    def features(self, tokens: Tensor, query_positions: Tensor | None = None) -> Tensor:
        """Token features [B, N, dim] after the final LayerNorm (``query_positions``: checked with the tokens,
        in the same read-back)."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.long, torch.int, torch.int16):
            raise ValueError(f"tokens must be an integer tensor [B, N], got {tokens.dtype} {list(tokens.shape)}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's max_len={self.max_len}")
        queries = () if query_positions is None else (("query positions", query_positions, tokens.shape[1]),)
        check_index_ranges(("token ids", tokens, self.vocab_size), *queries)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        layer_state: dict = {}
        for index, block in enumerate(self.blocks):
            x = block(x, None, layer_state)
            if self.state_norms is not None:
                x = x + self.state_norms[index](x)
        return self.final_norm(x)

    def forward(self, tokens: Tensor, query_positions: Tensor) -> Tensor:
        if query_positions.dim() != 2 or query_positions.shape[0] != tokens.shape[0]:
            raise ValueError(f"query_positions must be [B, K] with B = {tokens.shape[0]}, got "
                             f"{list(query_positions.shape)}")
        features = self.features(tokens, query_positions)
        index = query_positions.long().unsqueeze(-1).expand(-1, -1, features.shape[-1])
        return self.head(features.gather(1, index))
