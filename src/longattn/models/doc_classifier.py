"""The seven models of Singularformer's Table 4 (Wu et al., IJCAI 2023), each a registered classifier.

All share the framework of the paper's Figure 5: embedding (tokens, or CIFAR-100's 2x2 patch vectors
through a linear map) plus learned positions, a backbone of ``layers`` residual blocks, max + mean
pooling over real tokens and two dense layers with a ReLU (:class:`~longattn.models.singular_head.SingularHead`).
Only the backbone differs ("we use the same model framework as shown in Figure 5 but substitute the
backbone with different Transformer variants", section 4.2):

| model | attention | block | paper |
|---|---|---|---|
| ``post_ln`` | softmax | post-LN | Vaswani et al. 2017 |
| ``pre_ln`` | softmax | pre-LN | Xiong et al. 2020 |
| ``realformer`` | realformer (residual scores) | post-LN | He et al. 2021 (built on post-LN) |
| ``bigbird`` | bigbird | post-LN | Zaheer et al. 2020 (BERT layout) |
| ``linformer`` | linformer, k = 256 (its default) | post-LN | Wang et al. 2020 (RoBERTa layout) |
| ``flash`` | flash (GAU replaces the FFN), g = 256 (its default) | pre-LN | Hua et al. 2022 (pre-norm) |
| ``singularformer`` | singular (residual pseudo-token scores) | post-LN | this paper (RealFormer-style residual) |

The paper does not say which block layout each linear baseline used; the column "block" is our choice
(each model's own paper), and ``model.norm`` changes it.

Defaults are Table 2's: 6 layers, embedding and hidden size 384, 6 heads, dropout 0.2 in the embedding
layer and 0.1 in hidden layers; every weight of a linear or embedding layer is drawn from a truncated
normal with std 0.02 (cut at two standard deviations) and every bias is zero (section 4.2).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from torch import nn

from longattn.models.classifier import LRAClassifier
from longattn.models.encoder import LRAEncoder
from longattn.models.registry import register_model

__all__ = ["TABLE4_MODELS", "truncated_normal_init"]

# name -> (attention mechanism, block layout, description)
TABLE4_MODELS: dict[str, tuple[str, str, str]] = {
    "post_ln": ("softmax", "post", "Post-LN Transformer (Table 4 baseline)"),
    "pre_ln": ("softmax", "pre", "Pre-LN Transformer (Table 4 baseline)"),
    "realformer": ("realformer", "post", "RealFormer: post-LN with residual attention scores (Table 4 baseline)"),
    "bigbird": ("bigbird", "post", "BigBird sparse attention, post-LN (Table 4 baseline)"),
    "linformer": ("linformer", "post", "Linformer (k = 256), post-LN (Table 4 baseline)"),
    "flash": ("flash", "pre", "FLASH: gated attention units with mixed chunk attention (g = 256) (Table 4 baseline)"),
    "singularformer": ("singular", "post", "Singularformer (Wu et al. 2023): the model of its Table 4"),
}


def truncated_normal_init(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Weights of every Linear and Embedding ~ N(0, std^2) truncated to [-2 std, 2 std], biases zero,
    LayerNorms at identity (Singularformer section 4.2). Other parameters (e.g. FLASH's offsets) keep
    their mechanism's initialisation."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def _table4_builder(default_attention: str, default_norm: str) -> Callable[..., nn.Module]:
    """One builder per Table 4 model: the same signature, with the model's attention and block as defaults."""

    def build(
        vocab_size: int,
        num_classes: int,
        max_len: int,
        input_dim: int | None = None,
        attention: str = default_attention,
        attention_options: dict[str, Any] | None = None,
        layers: int = 6,
        dim: int = 384,
        hidden: int = 384,
        heads: int = 6,
        dropout: float = 0.1,
        embedding_dropout: float = 0.2,
        norm: Literal["pre", "post"] = default_norm,  # type: ignore[assignment]
        init_std: float | None = 0.02,
    ) -> nn.Module:
        """Figure 5's classifier with this backbone; ``input_dim`` set: inputs are vectors, not token ids;
        ``init_std=None`` keeps PyTorch's default initialisation."""
        encoder = LRAEncoder(
            vocab_size, max_len, attention=attention, attention_options=attention_options, layers=layers, dim=dim,
            hidden=hidden, heads=heads, dropout=dropout, embedding_dropout=embedding_dropout, norm=norm,
            pooling="maxmean", input_dim=input_dim,
        )
        model = LRAClassifier(encoder, num_classes, hidden=hidden, head="singular")
        if init_std is not None:
            if init_std <= 0:
                raise ValueError(f"init_std must be positive (or null for PyTorch's default), got {init_std}")
            truncated_normal_init(model, init_std)
        return model

    return build


for _name, (_attention, _norm, _description) in TABLE4_MODELS.items():
    register_model(_name, family="classifier", description=_description)(_table4_builder(_attention, _norm))
