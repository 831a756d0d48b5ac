"""Speculative decoding with a model's MTP heads: draft a few tokens cheaply, verify them in one pass.

A decode step on a CPU reads every weight of the model to produce one token per sequence; a pass
over a few tokens per sequence reads them once too. So the engine lets the model's multi-token
prediction heads (`atelier.mtp`, one decoder block each) guess the next D tokens, runs the model
once over the last token and the guesses (`BatchedForward.verify`), and keeps the guesses the model
agrees with (`speculative_accept` in sampling.py): at any temperature the tokens it emits are
distributed exactly as the model's own samples, and greedy output is the model's greedy output.

Head k at position i reads the hidden state h^{k-1}_i (h^0: the model's last hidden state before
its final norm) and the embedding of token t_{i+k}, and predicts t_{i+k+1}; its block attends over
its own earlier positions, kept in the engine's KV pool as layer L + k - 1 (L: the model's layers),
so they share the sequences' block tables and the prefix cache. `DraftHeads.draft` runs every head
over a sequence's newly verified positions (filling their keys) and drafts from the last one; a
head's input token past the known ones is the draft of the head before it. What a head computed
from a draft that was then rejected is recomputed on the next pass (each pass starts one position
back), so the heads' keys always describe the sequence as it is. Drafts only ever propose: a wrong
or stale head key lowers acceptance, never changes what is emitted.

`SpeculationPolicy` decides per step whether to speculate: it measures seconds per emitted token
of both kinds of step per batch size and keeps the faster (a large batch on a CPU is compute
bound, and a pass over D+1 tokens a sequence then costs more than the tokens it saves; low
acceptance does the same), probing the other now and then. Seconds per token are totals over
several steps, seconds over tokens: a speculative step emits one token most of the time and
several now and then, so one step, or the median step, says nothing of what speculation yields.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from atelier.inference.forward import BatchedForward, Layer, PackedLinear, _eps, _norm
from atelier.inference.sampling import MIN_TEMPERATURE, draw_from


class Head(NamedTuple):
    norm_h: torch.Tensor
    norm_e: torch.Tensor
    eps: float
    proj: PackedLinear
    layer: Layer
    kv_layer: int      # the pool layer that holds this head's keys and values


class DraftRun(NamedTuple):
    """One sequence's positions `start .. start + n - 1` to run the heads over: their model hidden
    states [n, M], and the sequence's tokens (at least `start + n + 1`: the last position's next
    token is the newest one, sampled but not yet verified)."""

    hidden_nM: torch.Tensor
    tokens: list[int]
    start: int
    table: list[int]
    temperature: float
    generator: torch.Generator


class Drafted(NamedTuple):
    tokens: list[int]
    probs: list[torch.Tensor] | None   # each draft's distribution (sampled requests; None: greedy)


DRAFT_VOCAB = 8192


class DraftHeads:
    """A model's MTP heads as the engine runs them, beside its `BatchedForward`.

    Drafts come from the first `draft_vocab` token ids only: the vocabulary projection is most of
    a head's cost, and a byte-pair tokenizer numbers its tokens in merge order, so its low ids are
    the frequent ones (a draft outside them would only ever be a miss; the verification, over the
    whole vocabulary, keeps the output exact)."""

    def __init__(self, mtp, forward: BatchedForward, draft_vocab: int | None = None) -> None:
        config = forward.model.config
        first = len(forward.layers)
        if forward.kv.k_LHRD.shape[0] < first + len(mtp.heads):
            raise ValueError("the KV pool has no layers for the MTP heads (BatchedForward's extra_kv_layers)")
        self.mtp, self.forward = mtp, forward
        with torch.no_grad():
            head = forward.model.lm_head
            self.vocab = min(draft_vocab or DRAFT_VOCAB, head.weight.shape[0])
            bias = None if head.bias is None else head.bias[:self.vocab]
            self.lm_head = PackedLinear(head.weight[:self.vocab], bias)
            self.heads = [Head(h.norm_h.weight, h.norm_e.weight, _eps(h.norm_h), PackedLinear(h.proj.weight),
                               BatchedForward._layer(h.block, config), first + k) for k, h in enumerate(mtp.heads)]

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def linears(self) -> list[PackedLinear]:
        return [self.lm_head] + [lin for h in self.heads
                                 for lin in (h.proj, h.layer.qkv, h.layer.o, h.layer.gate_up, h.layer.down)]

    def refresh_weights(self) -> None:
        with torch.no_grad():
            for lin in self.linears:
                lin.refresh()

    @torch.inference_mode()
    def draft(self, runs: list[DraftRun]) -> list[Drafted]:
        """Every head over each run's positions (their keys stored), and each run's D drafts from
        its last position: the argmax of each head (greedy runs) or a draw from it at the run's
        temperature, with the distribution it was drawn from."""
        fw = self.forward
        batch = fw.flat_batch([(r.tokens[:r.start + len(r.hidden_nM)], r.start, r.table) for r in runs])
        last = torch.tensor([off + n - 1 for off, n, _, _ in batch.plans], device=fw.device)
        h_NM = torch.cat([r.hidden_nM for r in runs])
        drafts: list[list[int]] = [[] for _ in runs]
        probs: list[list[torch.Tensor]] = [[] for _ in runs]
        for k, head in enumerate(self.heads, 1):
            ids = [self._input_token(r, j, k, drafts[b]) for b, r in enumerate(runs)
                   for j in range(r.start, r.start + len(r.hidden_nM))]
            e_NM = fw.core.embed_tokens(torch.tensor(ids, dtype=torch.long, device=fw.device))
            x_NM = head.proj(torch.cat([_norm(head.norm_h, head.eps, h_NM),
                                        _norm(head.norm_e, head.eps, e_NM.to(h_NM.dtype))], dim=-1))
            h_NM = fw.run_layers(batch, x_NM[None], [(head.kv_layer, head.layer)])[0]
            normed = _norm(fw.core.norm.weight, _eps(fw.core.norm), h_NM[last])
            logits_BV = self.lm_head(normed).float().cpu()
            for b, (run, row) in enumerate(zip(runs, logits_BV)):
                if run.temperature < MIN_TEMPERATURE:
                    drafts[b].append(int(row.argmax()))
                    continue
                q_V = torch.zeros(fw.model.lm_head.weight.shape[0])
                q_V[:self.vocab] = torch.softmax(row / run.temperature, dim=-1)
                drafts[b].append(draw_from(q_V, run.generator))
                probs[b].append(q_V)
        return [Drafted(d, p if r.temperature >= MIN_TEMPERATURE else None) for d, p, r in zip(drafts, probs, runs)]

    @staticmethod
    def _input_token(run: DraftRun, j: int, k: int, drafts: list[int]) -> int:
        """Head k's input token at position j: t_{j+k}, a draft of an earlier head where the
        sequence does not reach it yet."""
        at = j + k
        return run.tokens[at] if at < len(run.tokens) else drafts[at - len(run.tokens)]


GAIN = 0.9            # the other kind becomes current when its seconds per token are below this share
FAR = 1.5             # a probe this many times slower per token backs the next one off 8x, not 2x
COMPARED = 16         # the current kind's last steps a probe is compared with
WARM_STEPS = 4        # plain steps at a batch size before its first probe of speculation
FIRST_GAP = 64        # steps of the current kind between probes after a switch (and half the first loss's)
LAST_GAP = 4096       # the longest gap between probes of a kind that keeps losing
PROBE_STEPS = 8       # a probe covers this many sequence-steps (steps x batch) ...
MIN_PROBE_STEPS = 4   # ... and at least this many steps (the longest is left out of its figure)


class SpeculationPolicy:
    """Whether the next step speculates (see the module docstring): `choose(batch)` before a step,
    `record(speculated, batch, seconds, tokens)` after it. `enabled` False: never; `max_batch`: no
    speculation above it. `mode` "auto" measures; "always" and "never" fix the choice (what a
    benchmark compares).

    Each batch size (in powers of two) starts with plain steps, the kind that cannot lose: a step
    of speculation costs more and only acceptance pays for it. After `WARM_STEPS` of them comes the
    first probe of speculation, a few steps long (more at batch 1, where one step's tokens vary
    most); the faster kind per token stays. Gaps between probes count that batch size's own steps
    (not seconds: what else the engine ran in between says nothing of this batch size): after a
    switch the other kind is probed `FIRST_GAP` steps later; a probe that loses doubles the gap
    (multiplies it by 8 where it lost by `FAR`: that far from paying, soon again would be waste)
    up to `LAST_GAP`. A probe also costs more than its steps: the heads first catch up on the
    positions decoded without them (a whole prompt's, on a new request). So where speculation
    does not pay it costs a few steps in a thousand, and where it does it is on within a few
    dozen steps."""

    MODES = ("auto", "always", "never")

    def __init__(self, enabled: bool, max_batch: int) -> None:
        self.enabled, self.max_batch = enabled, max_batch
        self.mode = "auto"
        self._current: dict[int, bool] = {}
        self._recent: dict[int, deque[tuple[float, int]]] = {}   # the current kind's (seconds, tokens)
        self._countdown: dict[int, int] = {}                      # current-kind steps until the next probe
        self._gap: dict[int, int] = {}
        self._probe: dict[int, list[tuple[float, int]]] = {}      # a running probe's steps
        self.switches = 0

    @staticmethod
    def bucket(batch: int) -> int:
        return max(1, batch).bit_length()

    @staticmethod
    def probe_steps(batch: int) -> int:
        return max(MIN_PROBE_STEPS, -(-PROBE_STEPS // max(1, batch)))

    @staticmethod
    def per_token(steps) -> float:
        """Seconds over tokens of `steps`, the longest step left out where there are 4 or more:
        a step that built a kernel (a new shape's first) takes seconds, and one such step would
        decide a probe."""
        steps = sorted(steps)[:-1] if len(steps) >= 4 else list(steps)
        return sum(s for s, _ in steps) / max(1, sum(t for _, t in steps))

    def choose(self, batch: int) -> bool:
        if not self.enabled or self.mode == "never":
            return False
        if self.mode == "always":
            return True
        if batch > self.max_batch:
            return False
        key = self.bucket(batch)
        current = self._current.setdefault(key, False)
        if key not in self._probe and self._countdown.setdefault(key, WARM_STEPS) <= 0:
            self._probe[key] = []
        return not current if key in self._probe else current

    def record(self, speculated: bool, batch: int, seconds: float, tokens: int) -> None:
        if not self.enabled or self.mode != "auto" or batch > self.max_batch or tokens <= 0:
            return
        key = self.bucket(batch)
        current = self._current.get(key, False)
        if speculated == current:
            self._recent.setdefault(key, deque(maxlen=COMPARED)).append((seconds, tokens))
            self._countdown[key] = self._countdown.get(key, WARM_STEPS) - 1
            return
        probe = self._probe.get(key)
        if probe is None:
            return
        probe.append((seconds, tokens))
        if len(probe) < self.probe_steps(batch):
            return
        del self._probe[key]
        ratio = self.per_token(probe) / max(self.per_token(self._recent.get(key, ())), 1e-12)
        if ratio < GAIN:
            self._current[key] = speculated
            self._recent[key] = deque(probe, maxlen=COMPARED)
            self.switches += 1
            gap = FIRST_GAP
        else:
            gap = min(LAST_GAP, (8 if ratio > FAR else 2) * self._gap.get(key, FIRST_GAP // 2))
        self._gap[key] = self._countdown[key] = gap
