"""Attention mechanisms behind one interface.

>>> from longattn import attention
>>> layer = attention.build("softmax", dim=64, heads=4)
>>> "softmax" in attention.available()
True

Every module of this package (except ``base``) defines and registers one mechanism; importing
the package registers them all.
"""

import importlib
import pkgutil

from longattn.attention.base import (
    AttentionBase,
    AttentionError,
    AttentionMap,
    Capabilities,
    MechanismSpec,
    QKVProjection,
    allow_tf32,
    available,
    build,
    capabilities,
    check_attention_mask,
    check_finite,
    check_qkv,
    collect_aux_losses,
    compute_dtype,
    exact_float32,
    exact_float32_op,
    force_path,
    get_spec,
    merge_heads,
    output_dtype,
    padding_safe,
    record_attention_maps,
    register_attention,
    split_heads,
    uses_gpu_path,
)

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = [
    "AttentionBase",
    "AttentionError",
    "AttentionMap",
    "Capabilities",
    "MechanismSpec",
    "QKVProjection",
    "allow_tf32",
    "available",
    "build",
    "capabilities",
    "check_attention_mask",
    "check_finite",
    "check_qkv",
    "collect_aux_losses",
    "compute_dtype",
    "exact_float32",
    "exact_float32_op",
    "force_path",
    "get_spec",
    "merge_heads",
    "output_dtype",
    "padding_safe",
    "record_attention_maps",
    "register_attention",
    "split_heads",
    "uses_gpu_path",
]
