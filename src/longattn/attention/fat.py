"""FAT: Fourier Attention for Transformer, the dense ablation of FSAT (Zhuang et al., ACL 2022, table 3).

Full softmax attention (eq. 5) with queries from X and keys/values from the pooled hidden-state
cross C (eq. 6); no sparse index prediction. Quadratic in the sequence length.
"""

from __future__ import annotations

from torch import Tensor, nn

from longattn.attention.base import AttentionBase, Capabilities, merge_heads, register_attention, split_heads
from longattn.attention.fsat import PooledHiddenStateCross
from longattn.attention.softmax import softmax_attention, softmax_attention_reference


@register_attention(
    "fat",
    capabilities=Capabilities(causal=False, subquadratic=False),
    functional=softmax_attention,
    reference=softmax_attention_reference,
    paper="Long-range Sequence Modeling with Predictable Sparse Attention / FSAT (Zhuang et al., ACL 2022), "
    "FAT ablation",
)
class FATAttention(AttentionBase):
    """FAT: softmax attention with K, V projected from the FFT pooled hidden-state cross (dense FSAT).

    Options (paper defaults): feature_map "dense" | "conv" (depth-wise separable, ``conv_kernel_size``
    5), feature_activation ("gelu"; the paper does not name one), scale (1/sqrt(Dh)), bias.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        max_len: int | None = None,
        causal: bool = False,
        feature_map: str = "dense",
        conv_kernel_size: int = 5,
        feature_activation: str = "gelu",
        scale: float | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(dim, heads, max_len, causal)
        self.scale = scale
        self.cross = PooledHiddenStateCross(dim, feature_map, conv_kernel_size, feature_activation)
        self.to_q = nn.Linear(dim, dim, bias=bias)  # eq. 6: Q from X
        self.to_k = nn.Linear(dim, dim, bias=bias)  # K, V from C
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        c = self.cross(x, attention_mask, input_masked=True)  # eqs. 1-4
        q = split_heads(self.to_q(x), self.heads)
        k = split_heads(self.to_k(c), self.heads)
        v = split_heads(self.to_v(c), self.heads)
        out = softmax_attention(q, k, v, attention_mask, scale=self.scale)  # eq. 5, padded keys masked
        return self.to_out(merge_heads(out))
