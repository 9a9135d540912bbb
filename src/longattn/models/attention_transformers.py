"""The Transformer forecaster of the Informer / Autoformer / FEDformer code family with one of longattn's
registered attention mechanisms as self-attention: the "Transformer", Reformer, Performer and Nystromformer
columns of SKTformer's Table 16.

:class:`~longattn.models.forecast_blocks.GenerativeTransformer` with ``longattn.attention.build(name, ...)`` in
every self-attention slot and full softmax cross-attention (the efficient mechanisms are self-attention only).

* ``transformer``: softmax everywhere, causal decoder self-attention (Vaswani et al. 2017 as the forecasting
  papers run it).
* ``reformer``: LSH attention (Kitaev et al. 2020) in the encoder-only form of the Autoformer/FEDformer code:
  one stack over [window; ``pred_len`` zeros], bucket size 4, 4 hashes, not causal.
* ``performer``: FAVOR+ (Choromanski et al. 2021), encoder-decoder, causal (prefix-sum) decoder self-attention.
* ``nystrom``: Nystrom attention (Xiong et al. 2021), encoder-decoder; the mechanism has no causal form, so the
  decoder self-attention is bidirectional (the placeholders it sees are zeros, nothing leaks).
"""

from __future__ import annotations

from typing import Any

from longattn import attention as attention_registry
from longattn.models.forecast_blocks import GenerativeTransformer
from longattn.models.registry import register_model


class AttentionTransformer(GenerativeTransformer):
    """GenerativeTransformer whose self-attention layers are registered mechanism ``attention``."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, *, attention: str,
                 attention_options: dict[str, Any] | None, decoder_causal: bool, form: str,
                 label_len: int | None, d_model: int, heads: int, encoder_layers: int, decoder_layers: int,
                 d_ff: int, dropout: float, activation: str, calendar_dim: int) -> None:
        options = dict(attention_options or {})
        max_len = seq_len + pred_len
        super().__init__(
            channels, seq_len, pred_len, label_len=label_len, d_model=d_model, heads=heads,
            encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
            activation=activation, calendar_dim=calendar_dim, form=form,
            encoder_attention=lambda: attention_registry.build(attention, d_model, heads, max_len=max_len, **options),
            decoder_attention=lambda: attention_registry.build(attention, d_model, heads, max_len=max_len,
                                                               causal=decoder_causal, **options),
        )


@register_model("transformer", family="forecaster")
class TransformerForecaster(AttentionTransformer):
    """The vanilla Transformer forecaster: 2 encoder / 1 decoder layers, d_model 512, 8 heads, d_ff 2048,
    dropout 0.05, GELU, label_len = seq_len // 2."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, label_len: int | None = None,
                 d_model: int = 512, heads: int = 8, encoder_layers: int = 2, decoder_layers: int = 1,
                 d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 attention_options: dict[str, Any] | None = None, calendar_dim: int = 0) -> None:
        super().__init__(channels, seq_len, pred_len, attention="softmax",
                         attention_options={"dropout": dropout, **(attention_options or {})}, decoder_causal=True,
                         form="encoder_decoder", label_len=label_len, d_model=d_model, heads=heads,
                         encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
                         activation=activation, calendar_dim=calendar_dim)


@register_model("reformer", family="forecaster")
class ReformerForecaster(AttentionTransformer):
    """Reformer forecaster: encoder-only over [window; zeros], LSH attention with bucket size 4 and 4 hashes
    (the Autoformer code's settings), 2 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.05."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, form: str = "encoder_only",
                 label_len: int | None = None, d_model: int = 512, heads: int = 8, encoder_layers: int = 2,
                 decoder_layers: int = 1, d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 bucket_size: int = 4, n_hashes: int = 4, calendar_dim: int = 0) -> None:
        super().__init__(channels, seq_len, pred_len, attention="reformer",
                         attention_options={"bucket_size": bucket_size, "n_hashes": n_hashes}, decoder_causal=True,
                         form=form, label_len=label_len, d_model=d_model, heads=heads,
                         encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
                         activation=activation, calendar_dim=calendar_dim)


@register_model("performer", family="forecaster")
class PerformerForecaster(AttentionTransformer):
    """Performer forecaster: encoder-decoder with FAVOR+ self-attention (256 orthogonal random features, causal in
    the decoder), 2 encoder / 1 decoder layers, d_model 512, 8 heads, d_ff 2048, dropout 0.05."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, form: str = "encoder_decoder",
                 label_len: int | None = None, d_model: int = 512, heads: int = 8, encoder_layers: int = 2,
                 decoder_layers: int = 1, d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 nb_features: int = 256, calendar_dim: int = 0) -> None:
        super().__init__(channels, seq_len, pred_len, attention="performer",
                         attention_options={"nb_features": nb_features}, decoder_causal=True, form=form,
                         label_len=label_len, d_model=d_model, heads=heads, encoder_layers=encoder_layers,
                         decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout, activation=activation,
                         calendar_dim=calendar_dim)


@register_model("nystromformer", family="forecaster")
class NystromForecaster(AttentionTransformer):
    """Nystromformer forecaster: encoder-decoder with Nystrom self-attention (32 landmarks, 6 pseudo-inverse
    iterations, kernel-33 value convolution), bidirectional in the decoder, 2 encoder / 1 decoder layers,
    d_model 512, 8 heads, d_ff 2048, dropout 0.05."""

    def __init__(self, channels: int, seq_len: int, pred_len: int, form: str = "encoder_decoder",
                 label_len: int | None = None, d_model: int = 512, heads: int = 8, encoder_layers: int = 2,
                 decoder_layers: int = 1, d_ff: int = 2048, dropout: float = 0.05, activation: str = "gelu",
                 num_landmarks: int = 32, pinv_iterations: int = 6, conv_kernel: int | None = 33,
                 calendar_dim: int = 0) -> None:
        super().__init__(channels, seq_len, pred_len, attention="nystrom",
                         attention_options={"num_landmarks": num_landmarks, "pinv_iterations": pinv_iterations,
                                            "conv_kernel": conv_kernel},
                         decoder_causal=False, form=form, label_len=label_len, d_model=d_model, heads=heads,
                         encoder_layers=encoder_layers, decoder_layers=decoder_layers, d_ff=d_ff, dropout=dropout,
                         activation=activation, calendar_dim=calendar_dim)
