"""The layer around the gated scan that GLA and Mamba-2 share (their module forms subclass it).

Both layers (GLA, Yang et al., ICML 2024, Section 4.4; Mamba-2, Dao and Gu, ICML 2024, Section 7.1 and Fig. 6)
turn the tokens x into the inputs of one scan, S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t
(:mod:`longattn.attention.ops.gated_scan`), and finish its output per head (norm, output gate, projection). What
differs between them is what a subclass writes: :meth:`GatedScanLayer.scan_inputs` (the queries, keys, values and
log decays of its paper) and :meth:`GatedScanLayer.finish`. The rest is the same for both and lives here:

* the forward: the scan over the sequence, causal or (``causal=False``) bidirectional;
* decoding (``recurrent``): the prefill's scan leaves the [K, V] state per head, each step is one token of the
  recurrence in which a padded token leaves the state as it is; ``RecurrentState.extra`` carries what a layer keeps
  besides (Mamba-2's convolution inputs, :meth:`GatedScanLayer.continued_extra`);
* the output gate o * SiLU(x W + b) per head of both papers (:meth:`GatedScanLayer.output_gated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from longattn.attention.base import AttentionBase, AttentionError, QKVProjection, split_heads
from longattn.attention.decoding import RecurrentState
from longattn.attention.ops.gated_scan import gated_scan_step, masked_gated_scan, without_padding

__all__ = ["GatedScanLayer", "ScanInputs"]


@dataclass
class ScanInputs:
    """The scan's inputs of a layer's tokens, [B, H, N, *]: queries (unscaled), keys, values and log decays
    (<= 0, per key channel or per head); ``skip``: what :meth:`GatedScanLayer.finish` reads besides the scan's
    output (Mamba-2's x for its D skip); ``carry``: what the decoding state continues from (Mamba-2's
    convolution inputs)."""

    query: Tensor
    key: Tensor
    value: Tensor
    log_decay: Tensor
    skip: Tensor | None = None
    carry: Tensor | None = None


class GatedScanLayer(AttentionBase):
    """Module form shared by ``gla`` and ``mamba2``: the scan and its decoding state around the subclass's
    :meth:`scan_inputs` and :meth:`finish`."""

    to_output_gate: nn.Linear | None  # the subclass's output gate projection (None: no gate)

    def __init__(self, dim: int, heads: int, max_len: int | None, causal: bool, *, chunk_size: int,
                 bias: bool) -> None:
        super().__init__(dim, heads, max_len, causal)
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise AttentionError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.proj = QKVProjection(dim, heads, bias=bias)
        self.chunk_size = chunk_size

    # -- what a layer defines -----------------------------------------------------------------------------
    def scan_inputs(self, x: Tensor, attention_mask: Tensor | None, extra: dict[str, Tensor]) -> ScanInputs:
        """The scan's inputs of tokens x [B, N, dim]; ``extra``: the decoding state's (empty before a sequence)."""
        raise NotImplementedError

    def finish(self, x: Tensor, heads_out: Tensor, inputs: ScanInputs) -> Tensor:
        """The scan's output per head [B, H, N, Dv] -> the layer's output [B, N, dim]."""
        raise NotImplementedError

    @property
    def scan_scale(self) -> float:
        """The factor of the queries in the scan."""
        return 1.0

    def continued_extra(self, inputs: ScanInputs, extra: dict[str, Tensor]) -> dict[str, Tensor]:
        """The decoding state's ``extra`` after ``inputs`` (``extra``: before them); nothing by default."""
        return {}

    # -- shared parts -------------------------------------------------------------------------------------
    def output_gated(self, x: Tensor, heads_out: Tensor) -> Tensor:
        """heads_out * SiLU(x W + b) per head, or heads_out as it is without the gate."""
        if self.to_output_gate is None:
            return heads_out
        return heads_out * split_heads(F.silu(self.to_output_gate(x)), self.heads)

    def _scan(self, inputs: ScanInputs, attention_mask: Tensor | None, is_causal: bool) -> tuple[Tensor, Tensor | None]:
        return masked_gated_scan(inputs.query, inputs.key, inputs.value, inputs.log_decay, attention_mask,
                                 is_causal=is_causal, scale=self.scan_scale, chunk=self.chunk_size)

    def attend(self, x: Tensor, attention_mask: Tensor | None, layer_state: dict | None) -> Tensor:
        inputs = self.scan_inputs(x, attention_mask, {})
        return self.finish(x, self._scan(inputs, attention_mask, self.causal)[0], inputs)

    # -- decoding: the [K, V] state per head and the layer's extra ------------------------------------------
    decode_state = "recurrent"

    def prefill_attend(self, x: Tensor, attention_mask: Tensor | None,
                       layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        inputs = self.scan_inputs(x, attention_mask, {})
        out, state = self._scan(inputs, attention_mask, True)
        return self.finish(x, out, inputs), RecurrentState(length=x.shape[1], sums=state,
                                                           extra=self.continued_extra(inputs, {}))

    def step_attend(self, x: Tensor, state: RecurrentState, real: Tensor | None,
                    layer_state: dict | None) -> tuple[Tensor, RecurrentState]:
        mask = None if real is None else real[:, None]
        inputs = self.scan_inputs(x, mask, state.extra)
        # a padded token leaves the state as it is: no key, no value, no decay
        key, value, log_decay = without_padding(mask, inputs.key, inputs.value, inputs.log_decay)
        out, state.sums = gated_scan_step(inputs.query * self.scan_scale, key, value, log_decay, state.sums)
        state.extra = self.continued_extra(inputs, state.extra)
        return self.finish(x, out, inputs), state
