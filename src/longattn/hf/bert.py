"""BERT-architecture encoders from transformers' BERT classes with any longattn mechanism, for the
transfer-learning experiment of SKTformer / S^3 (Table 3: MLM pretraining, then GLUE fine-tuning).

* ``bert_mlm`` (family ``mlm``): ``transformers.BertForMaskedLM`` (decoder tied to the word embeddings)
  whose self-attention is the chosen mechanism, from scratch or (``pretrained="minilm"``, a re-warm of a
  converted model) from the pretrained MiniLM-L6 with a new MLM head; ``forward(input_ids, attention_mask, predict)`` returns
  the vocabulary logits of the positions in the bool mask ``predict`` only (an MLM loss needs the 15%
  masked positions; all positions x 30,522 words would be most of the memory and time).
* ``bert_glue`` (family ``glue``): ``transformers.BertModel`` plus a classification / regression head on
  the pooled [CLS] (BERT's pooler) or the mean of the real tokens; starts from a ``bert_mlm`` run
  folder (``longattn pretrain --out``), from the pretrained MiniLM-L6 (``pretrained="minilm"``), or from
  scratch.

How a mechanism gets into the model (:func:`use_mechanism`):

* ``softmax``: transformers' own SDPA attention (the bridge's ``longattn_softmax`` is tested equal to it);
* the token mixers ``fnet`` and ``ponet`` replace the whole self-attention module (no query/key/value:
  FNet eq. 3 mixes the hidden states; PoNet eqs. 1-6 own their projections) and the model's output
  projection becomes the identity (FNet has none; PoNet has its own), the residual and LayerNorm stay;
* every other mechanism goes through :func:`longattn.hf.convert` (the model's Q/K/V, new parameters under
  ``.longattn.``; ``fresh`` projections for those that cannot use them). Mechanisms without attention
  dropout run without it (``ignore_dropout``); the hidden-state dropout of Table 15 stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from longattn.attention import build as build_mechanism
from longattn.attention import capabilities
from longattn.config import to_dict
from longattn.hf.bridge import _transformers, register
from longattn.hf.convert import NO_QKV_MAPPING, convert
from longattn.hf.minilm import minilm_path
from longattn.models.registry import register_model
from longattn.train.checkpoint import CheckpointError, load_checkpoint, load_weights

__all__ = ["BertGlue", "BertMLM", "BertShape", "MIXERS", "MixerSelfAttention", "bert_config", "use_mechanism"]

#: Token mixers that replace the self-attention module itself (no query/key/value to map).
MIXERS = frozenset({"fnet", "ponet"})
MINILM = "minilm"


@dataclass(frozen=True)
class BertShape:
    """The encoder size of a from-scratch model (the CPU preset's; the paper preset sets BERT-Base)."""

    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 1024


def bert_config(vocab_size: int, max_len: int, shape: BertShape, dropout: float) -> Any:
    """A ``transformers.BertConfig`` of this size; ``max_len`` is the position table's length."""
    transformers = _transformers()
    if shape.hidden_size % shape.heads:
        raise ValueError(f"hidden_size {shape.hidden_size} is not a multiple of heads {shape.heads}")
    return transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=shape.intermediate_size,
        max_position_embeddings=max_len, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        attn_implementation="sdpa",
    )


class MixerSelfAttention(nn.Module):
    """Stands in for ``BertSelfAttention``: the token mixer on the hidden states, ``(output, None)``."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        # attention_mask is the bridge's bool [B, N] key padding mask (None without padding)
        return self.mixer(hidden_states, attention_mask=attention_mask), None


def use_mechanism(bert: nn.Module, name: str, options: dict[str, Any], max_len: int, seed: int = 0) -> None:
    """Put mechanism ``name`` (with ``options``) into every layer of the ``transformers.BertModel`` ``bert``."""
    if name == "softmax" and not options:
        return
    if name in MIXERS:
        # The bridge's mask function hands the layers the bool [B, N] padding mask; no layer attends any more.
        bert.set_attn_implementation(register("softmax"))
        config = bert.config
        for index, layer in enumerate(bert.encoder.layer):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + index)
                mixer = build_mechanism(name, dim=config.hidden_size, heads=config.num_attention_heads,
                                        max_len=max_len, **options)
            layer.attention.self = MixerSelfAttention(mixer)
            layer.attention.output.dense = nn.Identity()  # FNet has no output projection; PoNet has its own
        return
    convert(bert, name, max_len=max_len if capabilities(name).needs_max_len else None, fresh=name in NO_QKV_MAPPING,
            ignore_dropout=True, seed=seed, **options)


# Parameters with no pretrained value when the encoder comes from MiniLM (the Trainer gives them optim.new_lr): a
# converted mechanism's (under ``.longattn.``) or a token mixer's. A pretraining run trained its own, a scratch
# model all; the heads (classifier, MLM) are new in every model and train at optim.lr, as in BERT's fine-tuning.
_NEW_MARKS = (".longattn.", ".mixer.")


def _added_by_conversion(model: nn.Module) -> list[nn.Parameter]:
    return [t for name, t in model.named_parameters() if any(mark in f".{name}" for mark in _NEW_MARKS)]


@register_model("bert_mlm", family="mlm", description="BERT (transformers) with any mechanism, MLM head")
class BertMLM(nn.Module):
    """``transformers.BertForMaskedLM`` with mechanism ``attention``; see the module docstring."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        attention: str = "softmax",
        attention_options: dict[str, Any] | None = None,
        hidden_size: int = BertShape.hidden_size,
        layers: int = BertShape.layers,
        heads: int = BertShape.heads,
        intermediate_size: int = BertShape.intermediate_size,
        dropout: float = 0.1,
        mechanism_seed: int = 0,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        transformers = _transformers()
        if pretrained == MINILM:  # a re-warm of the converted MiniLM: its size (the size options are unused)
            self.mlm = transformers.BertForMaskedLM.from_pretrained(str(minilm_path()), **_minilm_settings(dropout))
        elif pretrained is not None:
            raise ValueError(f"bert_mlm starts from scratch (pretrained: null) or from {MINILM!r}, got {pretrained!r}")
        else:
            shape = BertShape(hidden_size, layers, heads, intermediate_size)
            self.mlm = transformers.BertForMaskedLM(bert_config(vocab_size, max_len, shape, dropout))
        if self.mlm.config.vocab_size != vocab_size:
            raise ValueError(f"the encoder has a vocabulary of {self.mlm.config.vocab_size} words but the "
                             f"tokenizer has {vocab_size}")
        use_mechanism(self.mlm.bert, attention, dict(attention_options or {}), max_len, mechanism_seed)
        self._from_minilm = pretrained == MINILM

    def new_parameters(self) -> list[nn.Parameter]:
        """What the conversion added to MiniLM in a re-warm (``optim.new_lr``); none in a model from scratch."""
        return _added_by_conversion(self) if self._from_minilm else []

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, predict: Tensor) -> Tensor:
        """Vocabulary logits [M, V] of the M positions where ``predict`` [B, N] is True."""
        hidden = self.mlm.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.mlm.cls(hidden[predict])


def _pretrain_checkpoint(folder: Path) -> Path:
    for name in ("best.pt", "last.pt"):
        if (folder / "checkpoints" / name).is_file():
            return folder / "checkpoints" / name
    raise FileNotFoundError(f"{folder}/checkpoints has no best.pt or last.pt: is {folder} a finished "
                            "`longattn pretrain` run?")


def _from_pretrain_run(folder: Path, attention: str, options: dict[str, Any], dropout: float) -> nn.Module:
    """The encoder of a ``bert_mlm`` run folder, with its saved architecture, mechanism and weights."""
    saved_path = folder / "config.yaml"
    if not saved_path.is_file():
        raise FileNotFoundError(f"{saved_path} does not exist: pretrained= must be the --out folder of "
                                "`longattn pretrain`, or 'minilm'")
    from longattn.experiment.config import load_saved  # the experiment layer, which imports this module's models

    saved = to_dict(load_saved(saved_path))  # checked: a damaged or foreign config.yaml is an error naming it
    if saved.get("model_name") != "bert_mlm":
        raise ValueError(f"{folder} is a {saved.get('model_name')!r} run, not a bert_mlm pretraining")
    pretrained_options = (saved.get("attention_options") or {}).get(saved["attention"], {})
    if (saved["attention"], pretrained_options) != (attention, options):
        raise ValueError(f"{folder} was pretrained with attention {saved['attention']!r} {pretrained_options}; "
                         f"fine-tune it with the same (got {attention!r} {options})")
    model = saved["model"]
    max_len = int(saved["data"]["max_len"])
    checkpoint = _pretrain_checkpoint(folder)
    state = load_checkpoint(checkpoint)["model"]
    prefix = "mlm.bert."
    transformers = _transformers()
    if model.get("pretrained") == MINILM:  # a re-warmed MiniLM: MiniLM's architecture
        config = transformers.BertConfig.from_pretrained(str(minilm_path()), **_minilm_settings(dropout))
    else:
        shape = BertShape(model["hidden_size"], model["layers"], model["heads"], model["intermediate_size"])
        embeddings = state.get(prefix + "embeddings.word_embeddings.weight")
        if embeddings is None:
            raise CheckpointError(f"{checkpoint} holds no BERT encoder ({prefix}...): is {folder} a `longattn "
                                  "pretrain` run?")
        vocab_size = embeddings.shape[0]
        config = bert_config(vocab_size, max_len, shape, dropout)
    bert = transformers.BertModel(config)
    use_mechanism(bert, attention, options, max_len, model["mechanism_seed"])
    encoder_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    # BERT's pooler is trained by NSP, absent here; anything else that does not fit (a config.yaml edited since
    # the pretraining) is an error naming the checkpoint
    load_weights(bert, encoder_state, checkpoint, ignore=lambda name: name.startswith("pooler."))
    return bert


def _minilm_settings(dropout: float) -> dict[str, Any]:
    return {"local_files_only": True, "attn_implementation": "sdpa", "hidden_dropout_prob": dropout,
            "attention_probs_dropout_prob": dropout}


def _from_minilm(attention: str, options: dict[str, Any], max_len: int, dropout: float, seed: int) -> nn.Module:
    bert = _transformers().BertModel.from_pretrained(str(minilm_path()), **_minilm_settings(dropout))
    use_mechanism(bert, attention, options, max_len, seed)
    return bert


@register_model("bert_glue", family="glue", description="BERT (transformers) with any mechanism, GLUE head")
class BertGlue(nn.Module):
    """A BERT encoder plus dropout and a linear head: ``forward(input_ids, token_type_ids, attention_mask)
    -> [B, num_labels]`` (num_labels = 1: a regression score, STS-B).

    ``pretrained``: a ``longattn pretrain`` run folder (its architecture, mechanism and best weights;
    ``attention`` must be the one it was pretrained with), ``"minilm"`` (the pretrained MiniLM-L6,
    converted to ``attention``), or null (a from-scratch encoder of :class:`BertShape`'s size).
    ``pooling``: ``cls`` (BERT's pooler on [CLS], as BERT's GLUE runs) or ``mean`` over the real tokens
    (how all-MiniLM-L6-v2 was trained).
    """

    def __init__(
        self,
        vocab_size: int,
        num_labels: int,
        max_len: int,
        attention: str = "softmax",
        attention_options: dict[str, Any] | None = None,
        pretrained: str | None = None,
        pooling: Literal["cls", "mean"] = "cls",
        dropout: float = 0.1,
        mechanism_seed: int = 0,
    ) -> None:
        super().__init__()
        options = dict(attention_options or {})
        transformers = _transformers()
        if pretrained == MINILM:
            self.bert = _from_minilm(attention, options, max_len, dropout, mechanism_seed)
        elif pretrained is not None:
            self.bert = _from_pretrain_run(Path(pretrained), attention, options, dropout)
        else:
            self.bert = transformers.BertModel(bert_config(vocab_size, max_len, BertShape(), dropout))
            use_mechanism(self.bert, attention, options, max_len, mechanism_seed)
        if self.bert.config.vocab_size != vocab_size:
            raise ValueError(f"the encoder has a vocabulary of {self.bert.config.vocab_size} words but the "
                             f"task's tokenizer has {vocab_size}")
        if pooling == "mean":
            self.bert.pooler = None
        self.pooling = pooling
        self._from_minilm = pretrained == MINILM
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(self.bert.config.hidden_size, num_labels)
        nn.init.normal_(self.head.weight, std=self.bert.config.initializer_range)  # as BERT's classifier
        nn.init.zeros_(self.head.bias)

    def new_parameters(self) -> list[nn.Parameter]:
        """The encoder's parameters that start from random when it comes from MiniLM (``optim.new_lr``)."""
        return _added_by_conversion(self) if self._from_minilm else []

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None, attention_mask: Tensor | None) -> Tensor:
        out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        if self.pooling == "cls":
            pooled = out.pooler_output
        else:
            hidden = out.last_hidden_state
            weights = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).unsqueeze(-1)
            weights = weights.to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.head(self.dropout(pooled))
