"""Sampling: the drawn tokens follow the tempered distribution exactly, logprobs are the
tempered ones, greedy is the argmax, and a seed is a request's own."""

from __future__ import annotations

import math

import torch

from atelier.inference.sampling import MIN_TEMPERATURE, make_generator, sample_rows


def _chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty approximation, fine for df >= 3)."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    df = len(counts) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_drawn_tokens_follow_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -30.0])
    temperature = 0.7
    probs = torch.softmax(logits / temperature, dim=-1).tolist()
    rows = 40_000
    draws = sample_rows(logits.expand(rows, -1), [(temperature, 1.0, make_generator(i)) for i in range(rows)])
    counts = [0] * len(probs)
    for token, logprob, _ in draws:
        counts[token] += 1
        assert math.isclose(logprob, math.log(probs[token]), rel_tol=1e-5, abs_tol=1e-5)
    assert counts[7] == 0                        # probability ~1e-19: never drawn
    assert _chi_square_p(counts[:7], [p / sum(probs[:7]) for p in probs[:7]]) > 1e-3


def test_greedy_rows_beside_sampled_ones_and_tiny_temperatures():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    out = sample_rows(logits, [(0.0, 1.0, make_generator(0)), (1.0, 1.0, make_generator(1)),
                               (MIN_TEMPERATURE / 10, 1.0, make_generator(2))])
    assert out[0][0] == 1 and math.isclose(out[0][1], float(torch.log_softmax(logits[0], -1)[1]), rel_tol=1e-6)
    assert out[2][0] == 2 and math.isfinite(out[2][1])   # below MIN_TEMPERATURE: greedy, never NaN


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    alone = [sample_rows(logits[b:b + 1], [(0.9, 1.0, make_generator(100 + b))])[0] for b in range(6)]
    together = sample_rows(logits, [(0.9, 1.0, make_generator(100 + b)) for b in range(6)])
    assert [s.token for s in together] == [s.token for s in alone]


def test_top_logprobs_are_the_most_likely_tokens_of_the_same_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    out = sample_rows(logits, [(0.0, 1.0, make_generator(0)), (0.5, 1.0, make_generator(1))], top=[2, 0])
    want = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in out[0].top] == [1, 3]
    assert all(math.isclose(lp, float(want[t]), rel_tol=1e-6) for t, lp in out[0].top)
    assert out[1].top is None
