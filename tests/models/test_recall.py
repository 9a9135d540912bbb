"""Zoology's recall model with every mechanism: no position that must predict an answer can see it.

Causal form: the logits at a query position do not change when every later token changes (so a next-token
predictor never reads the token after its query, where a language model's answer would sit). Bidirectional
form: the answers enter the model nowhere (its input is the token ids and query positions; the answer token
is in the input only in its pair, tested with the generator), and its logits at a query do depend on later
tokens, which is what makes it bidirectional. Parametrised over the registry: every mechanism that has a
causal form is checked in it.
"""

import pytest
import torch

from longattn import attention
from longattn.data.mqar import collate, MQARDataset, multiquery_ar
from longattn.models.recall import RecallModel, resolve_causal
from longattn.tasks.mqar import query_accuracy, recall_step
from longattn.testing import DispatchCounter

VOCAB, LENGTH, PAIRS = 64, 64, 4
CAUSAL = [name for name in attention.available() if attention.capabilities(name).causal]
# The mechanisms the MQAR sweep runs (their bidirectional forms where they have no causal one).
SWEEP = ["softmax", "skeleton", "singular", "fsat", "skein", "nystrom", "performer", "linformer", "linear",
         "cosformer", "local", "bigbird", "luna", "flash"]


def _model(name: str, causal: bool | None) -> RecallModel:
    torch.manual_seed(0)
    return RecallModel(VOCAB, LENGTH, attention=name, causal=causal, dim=16, heads=1, hidden=32).eval()


def _logits(model: RecallModel, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)  # mechanisms that sample in eval mode draw the same samples for both inputs
    with torch.no_grad():
        return model(tokens, positions)


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_form_cannot_see_later_tokens(name):
    model = _model(name, True)
    assert model.causal
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    positions = torch.tensor([[10, 37], [20, 61]])
    before = _logits(model, tokens, positions)
    for column in range(positions.shape[1]):
        changed = tokens.clone()
        for row in range(2):
            q = int(positions[row, column])
            changed[row, q + 1:] = torch.randint(0, VOCAB, (LENGTH - q - 1,), generator=generator)
        after = _logits(model, changed, positions)
        torch.testing.assert_close(after[:, column], before[:, column], rtol=1e-4, atol=1e-5)
    # the test can fail: the same model run bidirectionally does read later tokens
    if name == "softmax":
        bidirectional = _model(name, False)
        changed = tokens.clone()
        changed[:, 62:] = (changed[:, 62:] + 1) % VOCAB
        assert not torch.allclose(_logits(bidirectional, tokens, positions), _logits(bidirectional, changed, positions))


@pytest.mark.parametrize("name", SWEEP)
def test_every_sweep_mechanism_trains_a_step_in_its_form(name):
    """Each mechanism of the sweep runs its default form (causal when it has one), forward and backward, and the
    answers reach the model only through the loss: the logits are the same whatever the answers are."""
    model = _model(name, None).train()
    assert model.causal == attention.capabilities(name).causal == resolve_causal(name, None)
    data = MQARDataset(multiquery_ar(4, LENGTH, PAIRS, vocab_size=VOCAB, seed=0))
    batch = collate([data[i] for i in range(4)])
    torch.manual_seed(2)
    out = recall_step(model, batch)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.predictions.shape == (4, PAIRS)
    assert model.token_embedding.weight.grad is not None
    model.eval()
    other = {**batch, "answers": (batch["answers"] + 1) % VOCAB}
    torch.manual_seed(3)
    first = recall_step(model, batch).predictions
    torch.manual_seed(3)
    assert torch.equal(recall_step(model, other).predictions, first)


def test_logits_only_at_query_positions_and_tied_head():
    model = _model("softmax", None)
    tokens = torch.randint(0, VOCAB, (3, LENGTH))
    positions = torch.tensor([[8, 9], [10, 63], [0, 1]])
    logits = _logits(model, tokens, positions)
    assert logits.shape == (3, 2, VOCAB)
    full = model.head(model.features(tokens))
    torch.testing.assert_close(logits, full.gather(1, positions[..., None].expand(-1, -1, VOCAB)))
    assert model.head.weight is model.token_embedding.weight
    assert query_accuracy(logits.argmax(-1).float(), logits.argmax(-1)) == 1.0


def test_bad_inputs_are_clear_errors():
    model = _model("softmax", None)
    tokens = torch.randint(0, VOCAB, (2, LENGTH))
    with pytest.raises(ValueError, match=rf"query positions must lie in \[0, {LENGTH}\), got \[0, {LENGTH}\]"):
        model(tokens, torch.tensor([[0], [LENGTH]]))
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\), got \[-1, "):
        model(tokens.index_fill(1, torch.tensor([3]), -1), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, LENGTH + 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(attention.AttentionError, match="causal"):
        RecallModel(VOCAB, LENGTH, attention="skeleton", causal=True)
    with pytest.raises(ValueError, match="init must be one of"):
        RecallModel(VOCAB, LENGTH, init="xavier")


@pytest.mark.parametrize("hidden", [0, 32])
def test_zoology_initialisation(hidden):
    """``init="zoology"``: N(0, 0.02) for every linear layer and embedding, zero biases, and the residual branches'
    last layers at 0.02 / sqrt(2 * layers) (zoology/model.py ``_init_weights``); ``"torch"`` leaves the
    mechanism's own initialisation."""
    torch.manual_seed(0)
    model = RecallModel(VOCAB, LENGTH, dim=256, hidden=hidden, layers=2, init="zoology")
    scaled = {name for name, _ in model.named_parameters() if name.endswith(("to_out.weight", "ffn.3.weight"))}
    assert len(scaled) == (4 if hidden else 2)
    for name, parameter in model.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            assert torch.count_nonzero(parameter) == 0, name
        elif parameter.dim() == 2:
            expected = 0.02 / 2 if name in scaled else 0.02
            assert abs(parameter.std().item() / expected - 1) < 0.05, (name, parameter.std().item())
    torch.manual_seed(0)
    default = RecallModel(VOCAB, LENGTH, dim=256, hidden=hidden, layers=2, init="torch")
    assert default.blocks[0].attention.proj.to_q.weight.std() > 0.03  # kaiming-uniform: 1 / sqrt(3 * 256)


def test_identity_state_mixer_adds_the_normalised_stream():
    """Zoology's block with the identity as state mixer: after the mechanism, the stream gains LN2(x) (what the
    identity returns and the next residual adds); with an MLP the option changes nothing."""
    torch.manual_seed(0)
    model = RecallModel(VOCAB, LENGTH, dim=16, identity_state_mixer=True, embedding_dropout=0.0).eval()
    tokens = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(LENGTH))
        for block, norm in zip(model.blocks, model.state_norms):
            x = x + block.attention(block.norm_attention(x), None, {})
            x = x + norm(x)
        torch.testing.assert_close(model.features(tokens), model.final_norm(x))
    assert RecallModel(VOCAB, LENGTH, dim=16, hidden=32, identity_state_mixer=True).state_norms is None
    assert RecallModel(VOCAB, LENGTH, dim=16).state_norms is None


def test_a_training_step_reads_back_to_the_host_once(monkeypatch):
    """On a GPU every read-back stalls the queue of kernels: a step of the MQAR model reads its input check's
    four extrema in one ``tolist``, and the step itself (loss at the batch's query slots, predictions padded to
    the task's width) reads nothing (no scalar read, ``int(tensor)`` or ``.item()``)."""
    model = _model("softmax", None).train()
    data = MQARDataset(multiquery_ar(4, LENGTH, PAIRS, vocab_size=VOCAB, seed=0))
    batch = collate([data[i] for i in range(4)])
    lists = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: lists.append(self.shape) or tolist(self))
    with DispatchCounter() as ops:
        out = recall_step(model, batch, query_width=PAIRS + 3)
        out.loss.backward()
    assert ops.counts["aten._local_scalar_dense"] == 0 and lists == [(4,)]
    assert out.predictions.shape == out.targets.shape == (4, PAIRS + 3)
