"""Choosing the next token from logits, and the logprob we report for it.

Which logprob: `log_softmax(logits / temperature)` of the chosen token —
the temperature-scaled distribution *before* top-p truncation. That is the
distribution the trainer can recompute exactly from its own forward pass
(temperature is a known scalar; top-p truncation depends on the whole sorted
tail and is usually left out of importance ratios). With `top_p == 1` it is
exactly the distribution sampled from. With `temperature == 0` (greedy) the
token is the argmax and the logprob is that of the untempered distribution,
`log_softmax(logits)`.

A temperature below `MIN_TEMPERATURE` is greedy (as vLLM treats it): dividing
the logits by it would overflow them.

Randomness: every request owns a `torch.Generator` seeded from its `seed`
(or from the OS when `seed` is None), so the same seed and prompt give the
same tokens regardless of what else shares the batch. A token is drawn by
inverting the distribution's cumulative sum at one uniform number from the
request's generator: exactly the categorical distribution, and the cumulative
sums of every sampled row of a batch are one operation (a draw per row with
`torch.multinomial` was a large part of a decode step: docs/log/2026-12-06-rollout-engine.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_TEMPERATURE = 1e-5


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


class Sampled(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    """The most likely tokens and their logprobs (the same distribution), most likely first, when
    asked for (`sample_rows`'s `top`)."""


def sample_token(logits_V: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator) -> tuple[int, float]:
    """Return (token id, logprob as defined in the module docstring) for one row of fp32 logits."""
    token, logprob, _ = sample_rows(logits_V[None], [(temperature, top_p, generator)])[0]
    return token, logprob


def tempered(logits_BV: torch.Tensor, temperatures: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits each row's logprobs are of (divided by its temperature; greedy rows as they are)
    and their log-sum-exp: logprob = scaled - lse."""
    temps = [t if t >= MIN_TEMPERATURE else 1.0 for t in temperatures]
    scaled_BV = logits_BV if all(t == 1.0 for t in temps) else logits_BV / torch.tensor(temps)[:, None]
    return scaled_BV, torch.logsumexp(scaled_BV, dim=-1)


def most_likely(scaled_BV: torch.Tensor, lse_B: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely tokens of each row and their logprobs, most likely first."""
    values, ids = scaled_BV.topk(min(k, scaled_BV.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), (values - lse_B[:, None]).tolist())]


def sample_rows(logits_BV: torch.Tensor, params: list[tuple[float, float, torch.Generator]],
                top: list[int] | None = None) -> list[Sampled]:
    """`sample_token` for every row b of `logits_BV` with `params[b] = (temperature, top_p, generator)`;
    with `top`, row b also gets its `top[b]` most likely tokens (none where it is 0).

    One argmax and one log-sum-exp for the whole batch (no [B, V] log-softmax is materialised);
    only sampled rows (temperature > 0) draw, each from its own generator.
    """
    logits_BV = logits_BV.float().cpu()
    scaled_BV, lse_B = tempered(logits_BV, [t for t, _, _ in params])
    tokens = logits_BV.argmax(dim=-1).tolist()
    drawn = [b for b, (t, top_p, _) in enumerate(params) if t >= MIN_TEMPERATURE and top_p >= 1.0]
    if drawn:
        rows = torch.tensor(drawn)
        picked = _draw_rows(scaled_BV[rows] - lse_B[rows, None], [params[b][2] for b in drawn])
        for b, token in zip(drawn, picked):
            tokens[b] = token
    for b, (temperature, top_p, generator) in enumerate(params):
        if temperature >= MIN_TEMPERATURE and top_p < 1.0:
            tokens[b] = _draw(scaled_BV[b] - lse_B[b], top_p, generator)
    logps = (scaled_BV.gather(1, torch.tensor(tokens)[:, None])[:, 0] - lse_B).tolist()
    alternatives: list[list[tuple[int, float]] | None] = [None] * len(tokens)
    wanted = [b for b, k in enumerate(top or []) if k > 0]
    if wanted:
        rows = torch.tensor(wanted)
        for b, best in zip(wanted, most_likely(scaled_BV[rows], lse_B[rows], max(top[b] for b in wanted))):
            alternatives[b] = best[:top[b]]
    return [Sampled(t, lp, alt) for t, lp, alt in zip(tokens, logps, alternatives)]


def _draw_rows(logp_RV: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token from each row's distribution `exp(logp_RV[r])`, at a uniform number from
    `generators[r]`: the first token whose cumulative probability passes it (never a token of
    probability zero). The sums are float64, so rounding moves no token's probability by more
    than ~1e-16."""
    cdf_RV = logp_RV.exp().cumsum(dim=-1, dtype=torch.float64)
    u_R1 = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])[:, None]
    picked = torch.searchsorted(cdf_RV, u_R1 * cdf_RV[:, -1:], right=True)[:, 0]
    return picked.clamp_(max=logp_RV.shape[1] - 1).tolist()


def _draw(logp_V: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    return int(torch.multinomial(nucleus(logp_V.exp(), top_p), 1, generator=generator))


def nucleus(probs_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs_V` with all but the smallest set of most likely tokens whose mass reaches `top_p` set
    to zero (always at least one token; not renormalised). `top_p` 1: as it is."""
    if top_p >= 1.0:
        return probs_V
    sorted_p, order = torch.sort(probs_V, descending=True)
    cumulative = torch.cumsum(sorted_p, dim=-1)
    drop = (cumulative - sorted_p) >= top_p
    return torch.zeros_like(probs_V).scatter_(0, order, sorted_p.masked_fill(drop, 0.0))


def draw_from(weights_V: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability proportional to `weights_V` (>= 0, not necessarily summing to
    one), at a uniform number from `generator`, by inverting the float64 cumulative sum."""
    cdf_V = weights_V.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return min(int(torch.searchsorted(cdf_V, (u * cdf_V[-1])[None], right=True)[0]), weights_V.shape[0] - 1)


def speculative_accept(logits_KV: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor | None] | None,
                       temperature: float, top_p: float, generator: torch.Generator) -> list[tuple[int, float]]:
    """The tokens a speculative step emits and their logprobs: `logits_KV` are the model's fp32
    logits at the step's K = len(drafts) + 1 positions (after the last token, then after each
    draft), `draft_probs[i]` the distribution draft i was drawn from (None: greedy drafts; an entry
    None: a draft chosen, not drawn, as a prompt lookup's, whose distribution is all on it).

    Standard speculative sampling: draft i is kept with probability min(1, p_i(d) / q_i(d)) (p_i:
    the model's distribution there, tempered and top-p cut as `sample_rows` samples); at the first
    rejection a token is drawn from max(p_i - q_i, 0) and the step ends; when every draft is kept
    one more token is drawn from p_K. The emitted tokens are distributed exactly as the model's
    samples. Greedy (temperature below `MIN_TEMPERATURE`): drafts are kept while each is the argmax,
    and the first argmax that differs (or the last position's) ends the step. Logprobs are as
    `sample_rows` reports them."""
    scaled_KV, lse_K = tempered(logits_KV.float(), [temperature] * logits_KV.shape[0])
    logp_KV = scaled_KV - lse_K[:, None]
    out: list[int] = []
    if temperature < MIN_TEMPERATURE:
        best = logits_KV.argmax(dim=-1).tolist()
        for i, d in enumerate(drafts):
            out.append(best[i])
            if best[i] != d:
                break
        else:
            out.append(best[len(drafts)])
    else:
        for i, d in enumerate(drafts):
            p_V = nucleus(logp_KV[i].exp(), top_p)
            p_V = p_V / p_V.sum()
            q_V = draft_probs[i]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * (1.0 if q_V is None else float(q_V[d])) < float(p_V[d]):   # (u = 0 never keeps p = 0)
                out.append(d)
                continue
            if q_V is None:   # a draft not drawn (q: all mass on it): the residual is p without it
                residual_V = p_V.clone()
                residual_V[d] = 0.0
            else:
                residual_V = (p_V - q_V).clamp_(min=0.0)
            # no mass left over only when q is p up to rounding: then p itself
            out.append(draw_from(residual_V if float(residual_V.sum()) > 0 else p_V, generator))
            break
        else:
            out.append(draw_from(nucleus(logp_KV[len(drafts)].exp(), top_p), generator))
    return [(t, float(logp_KV[i, t])) for i, t in enumerate(out)]
