"""V-Mean (Skeinformer paper, Sec. 5 and Table 1): the rank-one baseline (1/n) 1 1^T V.

Every position outputs the mean of the values of the real tokens; queries and keys play no part.
The Skeinformer paper uses it as the ablation of row normalisation without any sub-sample.
"""

from __future__ import annotations

from torch import Tensor, nn

from longattn.attention.base import (
    AttentionBase,
    Capabilities,
    check_qkv,
    compute_dtype,
    merge_heads,
    padding_safe,
    register_attention,
    split_heads,
)


@padding_safe
def vmean_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """(1/m) 1 1^T V over the m real tokens of each sequence, [B, H, N, Dh].

    ``query`` and ``key`` are only checked for shape. A sequence without real tokens gives zeros.
    """
    check_qkv(query, key, value, attention_mask)
    work = compute_dtype(value.dtype)  # the sum over N tokens in float32 for half values
    if attention_mask is None:
        mean = value.mean(dim=2, keepdim=True, dtype=work)
    else:
        real = attention_mask[:, None, :, None]
        # Padded values are excluded by selection (not by multiplication), so inf/nan there cannot leak.
        total = value.masked_fill(~real, 0.0).sum(dim=2, keepdim=True, dtype=work)
        mean = total / real.sum(dim=2, keepdim=True).clamp(min=1).to(work)
    return mean.to(value.dtype).expand_as(value)


@padding_safe
def vmean_attention_reference(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """The literal matrix product W V with W = (1/m) 1 1_real^T, [N x N] per sequence; tests only."""
    batch, heads, length, _ = value.shape
    real = value.new_ones(batch, length) if attention_mask is None else attention_mask.to(value.dtype)
    weights = real[:, None, None, :].expand(batch, heads, length, length) / real.sum(-1).clamp(min=1)[:, None, None, None]
    return weights @ value.masked_fill(real[:, None, :, None] == 0, 0.0)


@register_attention(
    "vmean",
    capabilities=Capabilities(subquadratic=True),
    functional=vmean_attention,
    reference=vmean_attention_reference,
    paper="Skeinformer (Chen et al., NAACL 2022), V-Mean baseline",
)
class VMeanAttention(AttentionBase):
    """V-Mean: every position gets the mean value vector of the real tokens (rank-one baseline)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        # Only values are used, so there are no query/key projections (no parameters without gradient).
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        v = split_heads(self.to_v(x), self.heads)
        return self.to_out(merge_heads(vmean_attention(v, v, v, attention_mask)))
