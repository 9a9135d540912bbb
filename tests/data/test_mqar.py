"""The MQAR generator against Zoology's definition: distinct keys, values from their own half, the power-law
query slots (goodness of fit), determinism per seed, and answers that appear nowhere but in their pair."""

import numpy as np
import pytest
import torch
from scipy import stats

from longattn.data.mqar import FILLER, IGNORE, MQARDataset, collate, gap_probabilities, multiquery_ar


def test_layout_keys_values_and_queries():
    n, length, pairs, vocab = 200, 64, 8, 8192
    e = multiquery_ar(n, length, pairs, vocab_size=vocab, seed=3)
    inputs = e.inputs.long()
    keys, values = inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2]
    assert e.inputs.shape == (n, length) and e.query_positions.shape == e.answers.shape == (n, pairs)
    # keys distinct per sequence and from [1, vocab / 2); values distinct and from [vocab / 2, vocab)
    assert all(len(set(row.tolist())) == pairs for row in keys)
    assert all(len(set(row.tolist())) == pairs for row in values)
    assert int(keys.min()) >= 1 and int(keys.max()) < vocab // 2
    assert int(values.min()) >= vocab // 2 and int(values.max()) < vocab
    # the j-th key is queried at query_positions[:, j], at an even offset of the query region, with its value
    assert torch.equal(inputs.gather(1, e.query_positions), keys)
    assert torch.equal(e.answers, values)
    offsets = e.query_positions - 2 * pairs
    assert int(offsets.min()) >= 0 and bool((offsets % 2 == 0).all()) and int(e.query_positions.max()) < length
    assert all(len(set(row.tolist())) == pairs for row in e.query_positions)
    # everything else in the query region is the filler
    region = inputs[:, 2 * pairs:].clone()
    region.scatter_(1, offsets, FILLER)
    assert bool((region == FILLER).all())
    # every token of the vocabulary's halves is used: nothing is left out of the draw
    many = multiquery_ar(2000, 64, 16, vocab_size=64, seed=0).inputs.long()
    assert set(many[:, 0:32:2].unique().tolist()) == set(range(1, 32))
    assert set(many[:, 1:32:2].unique().tolist()) == set(range(32, 64))


def test_answers_are_in_the_input_only_in_their_pair():
    """No position that predicts an answer can read it: the value of a queried key occurs once in the input, in
    its pair of the context (before every query), never in the query region; with random fillers too, the
    token after a query is not its answer more often than chance."""
    pairs = 16
    e = multiquery_ar(500, 256, pairs, seed=1)
    inputs = e.inputs.long()
    occurrences = (inputs.unsqueeze(1) == e.answers.unsqueeze(-1)).sum(-1)  # [n, K]
    assert bool((occurrences == 1).all())
    where = (inputs.unsqueeze(1) == e.answers.unsqueeze(-1)).float().argmax(-1)
    assert torch.equal(where, torch.arange(1, 2 * pairs, 2).expand_as(where))
    assert bool((where < e.query_positions).all())
    noisy = multiquery_ar(500, 256, pairs, seed=1, random_non_queries=True)
    after = noisy.inputs.long().gather(1, noisy.query_positions + 1)
    assert float((after == noisy.answers).float().mean()) < 0.01  # chance is 1 / 8192
    assert not bool((noisy.inputs[:, 2 * pairs:] == FILLER).all())  # the fillers are random tokens


def test_deterministic_per_seed():
    a = multiquery_ar(64, 128, 8, seed=7)
    b = multiquery_ar(64, 128, 8, seed=7)
    c = multiquery_ar(64, 128, 8, seed=8)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.query_positions, b.query_positions)
    assert not torch.equal(a.inputs, c.inputs)
    noisy = [multiquery_ar(16, 64, 4, seed=2, random_non_queries=True).inputs for _ in range(2)]
    assert torch.equal(*noisy)


def _pooled(observed: np.ndarray, expected: np.ndarray, minimum: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Adjacent bins merged from the tail until each expects at least ``minimum`` (the chi-square condition)."""
    obs, exp, o, x = [], [], 0.0, 0.0
    for a, b in zip(observed, expected):
        o, x = o + a, x + b
        if x >= minimum:
            obs.append(o), exp.append(x)
            o, x = 0.0, 0.0
    obs[-1] += o
    exp[-1] += x
    return np.array(obs), np.array(exp)


def test_query_slots_follow_the_power_law():
    """Zoology draws the slots one after another with p_g ~ (g + 1) ** (a - 1): the first slot of every sequence
    follows p, and the second follows p renormalised over the slots the first left (chi-square tests)."""
    n, length, pairs, a = 20000, 128, 4, 0.01
    space = (length - 2 * pairs) // 2
    p = gap_probabilities(space, a)
    e = multiquery_ar(n, length, pairs, power_a=a, seed=11)
    slots = ((e.query_positions - 2 * pairs) // 2).numpy()
    first = np.bincount(slots[:, 0], minlength=space)
    assert stats.chisquare(*_pooled(first, n * p)).pvalue > 1e-3
    # E[count of slot g as the second draw] = sum over sequences of p_g / (1 - p_first), for g != first
    expected = (p[None, :] / (1 - p[slots[:, 0]])[:, None])
    expected[np.arange(n), slots[:, 0]] = 0.0
    second = np.bincount(slots[:, 1], minlength=space)
    assert stats.chisquare(*_pooled(second, expected.sum(0))).pvalue > 1e-3
    # the test can fail: uniform slots are rejected
    uniform = np.bincount(np.random.default_rng(0).integers(0, space, n), minlength=space)
    assert stats.chisquare(*_pooled(uniform, n * p)).pvalue < 1e-6
    # power_a = 1 is uniform (Zoology's note)
    assert np.allclose(gap_probabilities(10, 1.0), 0.1)


@pytest.mark.parametrize("length, pairs, message", [(63, 4, "even"), (12, 4, "too short"), (64, 0, "at least 1")])
def test_bad_settings_are_clear_errors(length, pairs, message):
    with pytest.raises(ValueError, match=message):
        multiquery_ar(4, length, pairs)
    with pytest.raises(ValueError, match="distinct"):
        multiquery_ar(4, 64, 8, vocab_size=12)


def test_dataset_and_collate():
    data = MQARDataset(multiquery_ar(5, 32, 2, seed=0))
    batch = collate([data[i] for i in range(3)])
    assert batch["tokens"].dtype == torch.long and batch["tokens"].shape == (3, 32)
    assert batch["query_positions"].shape == batch["answers"].shape == (3, 2)


def test_mixed_segments_are_padded_and_unpadded_alone():
    """A dataset of several (seq_len, pairs) segments: items in order, per-example lengths for length grouping,
    a batch of one segment stacked as it is, a mixed batch padded (tokens with the filler at the end, queries
    with IGNORE answers) to the batch's most queries."""
    short, long = multiquery_ar(3, 16, 2, seed=0), multiquery_ar(2, 32, 4, seed=1)
    data = MQARDataset([short, long])
    assert len(data) == 5 and data.lengths() == [16, 16, 16, 32, 32]
    assert torch.equal(data[3]["tokens"], long.inputs[0]) and torch.equal(data[-1]["answers"], long.answers[1])
    with pytest.raises(IndexError):
        data[5]
    alone = collate([data[0], data[1]])
    assert alone["tokens"].shape == (2, 16) and bool((alone["answers"] != IGNORE).all())
    mixed = collate([data[0], data[4]])
    assert mixed["tokens"].shape == (2, 32) and mixed["answers"].shape == (2, 4)
    assert torch.equal(mixed["tokens"][0, :16], short.inputs[0].long())
    assert bool((mixed["tokens"][0, 16:] == FILLER).all())
    assert torch.equal(mixed["answers"][0, :2], short.answers[0]) and bool((mixed["answers"][0, 2:] == IGNORE).all())
    assert torch.equal(mixed["answers"][1], long.answers[1])
