"""Any longattn mechanism inside a Hugging Face ``transformers`` model (``pip install 'longattn[hf]'``).

>>> import longattn.hf                                        # doctest: +SKIP
>>> key = longattn.hf.register("nystrom", num_landmarks=32)   # "longattn_nystrom"  # doctest: +SKIP
>>> model = AutoModel.from_pretrained(path, attn_implementation=key)  # doctest: +SKIP

* :func:`register` / :func:`register_all` / :func:`enable`: mechanisms that are a function of the
  model's q, k, v, through transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.
* :func:`convert` / :func:`from_pretrained`: mechanisms that own parameters or state, added to a
  pretrained model whose Q/K/V/O weights they keep.

transformers is imported only when these functions run; see docs/hf.md.
"""

from longattn.hf.bridge import (
    CONVERTED_KEY,
    FUNCTION_FORM_OPTIONS,
    attention_modules,
    check_dispatch,
    enable,
    function_path_names,
    implementation_key,
    key_padding_mask,
    register,
    register_all,
    registered,
    unregister,
)
from longattn.hf.convert import NO_QKV_MAPPING, convert, from_pretrained
from longattn.hf.minilm import load_bert, load_tokenizer, minilm_path

__all__ = [
    "CONVERTED_KEY",
    "FUNCTION_FORM_OPTIONS",
    "NO_QKV_MAPPING",
    "attention_modules",
    "check_dispatch",
    "convert",
    "enable",
    "from_pretrained",
    "function_path_names",
    "implementation_key",
    "key_padding_mask",
    "load_bert",
    "load_tokenizer",
    "minilm_path",
    "register",
    "register_all",
    "registered",
    "unregister",
]
