"""Choosing the next token from logits, and the logprob we report for it.

Which logprob: `log_softmax(logits / temperature)` of the chosen token —
the temperature-scaled distribution *before* top-p truncation. That is the
distribution the trainer can recompute exactly from its own forward pass
(temperature is a known scalar; top-p truncation depends on the whole sorted
tail and is usually left out of importance ratios). With `top_p == 1` it is
exactly the distribution sampled from. With `temperature == 0` (greedy) the
token is the argmax and the logprob is that of the untempered distribution,
`log_softmax(logits)`.

Randomness: every request owns a `torch.Generator` seeded from its `seed`
(or from the OS when `seed` is None), so the same seed and prompt give the
same tokens regardless of what else shares the batch.
"""

from __future__ import annotations

import torch


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def sample_token(logits_V: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator) -> tuple[int, float]:
    """Return (token id, logprob as defined in the module docstring) for one row of fp32 logits."""
    logits_V = logits_V.float().cpu()
    if temperature <= 0:
        logp_V = torch.log_softmax(logits_V, dim=-1)
        token = int(torch.argmax(logits_V))
        return token, float(logp_V[token])
    logp_V = torch.log_softmax(logits_V / temperature, dim=-1)
    probs_V = logp_V.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs_V, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cumulative - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs_V = torch.zeros_like(probs_V).scatter_(0, order, sorted_p)
    token = int(torch.multinomial(probs_V, 1, generator=generator))
    return token, float(logp_V[token])
