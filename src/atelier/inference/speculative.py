"""Speculative decoding: draft a few tokens cheaply (a model's MTP heads, or lookup in the request's
own context), verify them in one pass.

A decode step on a CPU reads every weight of the model to produce one token per sequence; a pass
over a few tokens per sequence reads them once too. So the engine lets the model's multi-token
prediction heads (`atelier.mtp`, one decoder block each) guess the next D tokens, runs the model
once over the last token and the guesses (`BatchedForward.verify`), and keeps the guesses the model
agrees with (`speculative_accept` in sampling.py): at any temperature the tokens it emits are
distributed exactly as the model's own samples, and greedy output is the model's greedy output.

Head k at position i reads the hidden state h^{k-1}_i (h^0: the model's last hidden state before
its final norm) and the embedding of token t_{i+k}, and predicts t_{i+k+1}; its block attends over
its own earlier positions, kept in the engine's KV pool as layer L + k - 1 (L: the model's layers),
so they share the sequences' block tables and the prefix cache. `DraftHeads.draft` runs the heads
over a sequence's newly verified positions (filling their keys) and drafts from the last one; a
head's input token past the known ones is the draft of the head before it. What head k computed
from a draft is recomputed on the next pass (it starts k - 1 positions back: `HeadProgress`), so a
head that runs on every step holds keys that describe the sequence as it is. Drafts only ever
propose: a wrong or stale head key lowers acceptance, never changes what is emitted.

`PromptLookup` drafts without any model: where a request's last few tokens occurred earlier in
its context, the tokens that followed them there (an agent quotes what it read). A looked-up draft
is chosen, not drawn, and verified as one whose distribution is all on it. A request whose
context repeats itself drafts by lookup, the others with the heads; a model without heads can
speculate by lookup alone.

`SpeculationPolicy` decides per step whether to speculate and with how many of the heads: it
measures what each kind of step costs per batch size and keeps the one with the fewest seconds
per emitted token (a large batch on a CPU is compute bound, and a pass over D+1 tokens a sequence
then costs more than the tokens it saves; low acceptance does the same; and the last heads guess
worst, so fewer drafts can pay better), probing the others now and then. Tokens per step come
from the heads' acceptance over every verified draft, not from a probe's own few steps: a
speculative step emits one token most of the time and several now and then, so a few steps, or
the median step, say little of what speculation yields. A step with fewer drafts than heads runs
only the heads it drafts with; the others' keys then miss those positions, as after plain steps
(a stale key lowers acceptance, never changes what is emitted).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
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
    unseen: int = 0    # the heads attend to no position before this (`HeadProgress.unseen`)


class Drafted(NamedTuple):
    tokens: list[int]
    probs: list[torch.Tensor] | None   # each draft's distribution (sampled requests; None: greedy)


DRAFT_VOCAB = 8192
MAX_BACKLOG = 512
"""A request keeps the model's hidden states of at most this many positions its heads have yet to
run over (older ones the lagging heads then never see: their keys stay stale)."""


class HeadProgress:
    """Which of a request's positions each MTP head has final keys for, and the model's hidden
    states of the positions some head still has to run over (`DraftHeads.draft`'s input).

    Head k at position j reads token t_{j+k}, so after a pass whose last position is i (tokens
    known up to t_{i+1}) head k's keys are final up to i + 1 - k: past that they were computed from
    drafts, and the next pass starts there again. A pass with fewer drafts than heads runs only the
    first heads, and plain steps run none: the hidden states of the positions they skipped wait here
    (as the steps' own rows, joined only when a pass needs them: a step appends, it does not copy),
    and the next pass that runs a lagging head catches it up over them. Positions whose rows were
    never kept (the engine keeps none where it cannot speculate) stay stale for every head."""

    def __init__(self, heads: int) -> None:
        self.first = 0                      # the position of the first kept row
        self._chunks: deque[torch.Tensor] = deque()   # the kept rows [n, M], in position order
        self._rows = 0
        self.redo = [0] * heads             # per head: the first position its next pass must run
        self.unseen = 0                     # no head has keys before this position: they attend after it
        self._extended = False

    @property
    def end(self) -> int:
        """The position after the last kept row."""
        return self.first + self._rows

    def extend(self, first: int, hidden_nM: torch.Tensor, seen_before: bool = False, cap: bool = True) -> None:
        """The model's hidden states of positions `first ..`, just computed. Rows from `first` on
        replace any kept ones. Positions before the first rows, or in a gap since the kept ones,
        no head will ever run over: the heads attend from `first` on (`unseen`), unless
        `seen_before` (a prefix cache hit whose head keys an earlier request computed). Past
        `MAX_BACKLOG` rows the oldest go (`cap` False: not yet, a pass over them comes next)."""
        if not self._extended or first > self.end or first < self.first:
            if not seen_before:
                self.unseen = first
            self._chunks.clear()
            self.first, self._rows = first, 0
        elif first < self.end:
            self._keep(first - self.first)
        self._extended = True
        self._chunks.append(hidden_nM)
        self._rows += hidden_nM.shape[0]
        if cap:
            self._cap()
        self.redo = [max(r, self.first) for r in self.redo]

    def pending(self, depth: int) -> tuple[int, torch.Tensor]:
        """Where a pass of the first `depth` heads starts, and the hidden states from there on."""
        start = min(self.redo[:depth])
        if len(self._chunks) > 1:
            self._chunks = deque([torch.cat(list(self._chunks))])
        return start, self._chunks[0][start - self.first:]

    def ran(self, depth: int, last: int) -> None:
        """The first `depth` heads ran over every position up to `last`."""
        for k in range(depth):   # (the rows before `first` are gone: such a key stays as it is)
            self.redo[k] = max(self.first, last + 1 - k)
        self._drop(min(self.redo) - self.first)
        self._cap()

    def _cap(self) -> None:
        """At most `MAX_BACKLOG` rows. Where every head lags over the rows dropped, none will have
        keys there: the heads then attend from the rows kept on (a window over the recent past)."""
        over = self._rows - MAX_BACKLOG
        if over > 0:
            if max(self.redo) <= self.first:
                self.unseen = self.first + over
            self._drop(over)
            self.redo = [max(r, self.first) for r in self.redo]

    def _drop(self, n: int) -> None:
        """Forget the first `n` kept rows."""
        self.first, self._rows = self.first + n, self._rows - n
        while n > 0:
            head = self._chunks[0]
            if head.shape[0] <= n:
                n -= head.shape[0]
                self._chunks.popleft()
            else:
                self._chunks[0] = head[n:]
                n = 0

    def _keep(self, n: int) -> None:
        """Keep only the first `n` kept rows."""
        rows = torch.cat(list(self._chunks))[:n] if self._chunks else None
        self._chunks = deque([rows] if rows is not None and n else [])
        self._rows = n


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
    def draft(self, runs: list[DraftRun], depth: int | None = None) -> list[Drafted]:
        """The first `depth` heads (None: all) over each run's positions (their keys stored), and
        each run's `depth` drafts from its last position: the argmax of each head (greedy runs) or
        a draw from it at the run's temperature, with the distribution it was drawn from."""
        fw = self.forward
        batch = fw.flat_batch([(r.tokens[:r.start + len(r.hidden_nM)], r.start, r.table) for r in runs],
                              unseen=[r.unseen for r in runs])
        last = torch.tensor([off + n - 1 for off, n, _, _ in batch.plans], device=fw.device)
        h_NM = torch.cat([r.hidden_nM for r in runs])
        drafts: list[list[int]] = [[] for _ in runs]
        probs: list[list[torch.Tensor]] = [[] for _ in runs]
        for k, head in enumerate(self.heads[:depth], 1):
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


GAIN = 0.92           # another kind of step becomes current when its seconds per token are below this share
DEPTH_GAIN = 0.97     # ... of the current one's; this share between two depths that both speculate
RETURN_GAIN = 0.98    # ... and this share for plain steps replacing a speculative kind
FAR = 1.5             # a probe this many times slower per token backs the next one off 8x, not 2x
COMPARED = 16         # a kind's cost is over its last this many steps
WARM_STEPS = 4        # plain steps at a batch size before its first probe of speculation
FIRST_GAP = 64        # steps of the current kind between probes after a switch (and half the first loss's)
LAST_GAP = 4096       # the longest gap between probes of kinds that keep losing
PROBE_STEPS = 8       # a probe covers this many sequence-steps (steps x batch) ...
MIN_PROBE_STEPS = 4   # ... and at least this many steps (one that built a kernel is left out of its figure)
OUTLIER = 2.0         # a step over this many times its kind's median is left out of its cost
FRESH = 32            # a switch compares only costs measured within this many steps of each other
ACCEPTANCE_WINDOW = 256   # a head's acceptance is over about its last this many verified drafts
SHARE_WINDOW = 64         # one batch size's lookup share is over about its last this many sequence-steps
PRIOR = 2.0               # ... and starts from the head before it's, worth this many drafts
LOCAL_PRIOR = 8.0         # ... or, at one batch size, from every batch size's, worth this many


class Acceptance:
    """Each head's acceptance given that the drafts before it were accepted: exponentially weighted
    over about its last `ACCEPTANCE_WINDOW` verified drafts (so it follows the heads' drift as RL
    changes the weights). A head is tried only where every head before it guessed right, so a late
    head has few drafts to go by: each starts from the rate of the head before it (worth `PRIOR`
    drafts; the first from one in two), since a later head rarely guesses better. With a `prior`
    (the engine's acceptance over every batch size, for one batch size's), each head starts from
    the prior's rate instead, worth `LOCAL_PRIOR` drafts: text at one batch size (an agent's turns)
    can be guessed worse than at another (chat replies), and a probe's few drafts need support."""

    def __init__(self, heads: int, prior: "Acceptance | None" = None) -> None:
        self.tried = [0.0] * heads
        self.kept = [0.0] * heads
        self.prior = prior

    def observe(self, drafted: int, accepted: int) -> None:
        """One sequence's verification: `drafted` drafts, the first `accepted` of them kept (the
        drafts past the first rejected one were never tried)."""
        keep = 1.0 - 1.0 / ACCEPTANCE_WINDOW
        for j in range(min(drafted, accepted + 1)):
            self.tried[j] = self.tried[j] * keep + 1.0
            self.kept[j] = self.kept[j] * keep + (1.0 if j < accepted else 0.0)

    def rates(self) -> list[float]:
        """Every head's acceptance, first head first."""
        if self.prior is not None:
            return [(kept + LOCAL_PRIOR * rate) / (tried + LOCAL_PRIOR)
                    for tried, kept, rate in zip(self.tried, self.kept, self.prior.rates())]
        out, prior = [], 0.5
        for tried, kept in zip(self.tried, self.kept):
            prior = (kept + PRIOR * prior) / (tried + PRIOR)
            out.append(prior)
        return out

    def tokens(self, depth: int) -> float:
        """The tokens a sequence's step verifying `depth` drafts emits, on average: its correction
        or bonus token, and draft j where drafts 1..j are all kept."""
        total, chain = 1.0, 1.0
        for rate in self.rates()[:depth]:
            chain *= rate
            total += chain
        return total


class LookupYield:
    """What lookup drafts yield: how often a sequence's context repeats itself (its share of
    sequence-steps whose context held a repeat, exponentially weighted over about the last
    `window`), and the acceptance of the drafts it then proposes. With a `prior` (the engine's,
    for one batch size's), both start from the prior's, worth `LOCAL_PRIOR` steps. One batch
    size's share follows its last `SHARE_WINDOW` sequence-steps: two workloads that take turns at
    one batch size (an agent's turns that quote their context, chat replies that do not) each
    have theirs within a few dozen steps."""

    def __init__(self, prior: "LookupYield | None" = None, window: int = ACCEPTANCE_WINDOW) -> None:
        self.acceptance = Acceptance(LOOKUP_DRAFTS, prior.acceptance if prior is not None else None)
        self.steps = 0.0
        self.matched = 0.0
        self.prior = prior
        self.window = window

    def observe(self, drafted: int, accepted: int, matched: bool) -> None:
        """One sequence's speculative step: whether a lookup drafted it, and how that fared."""
        self.observe_share(matched)
        if matched:
            self.acceptance.observe(drafted, accepted)

    def observe_share(self, matched: bool) -> None:
        """One sequence-step: whether its context held a repeat (a plain step's too: the engine
        looks, which costs a few dictionary reads, so the share follows the text while no step
        speculates)."""
        keep = 1.0 - 1.0 / self.window
        self.steps = self.steps * keep + 1.0
        self.matched = self.matched * keep + float(matched)

    def share(self) -> float:
        """The share of sequence-steps a lookup drafts."""
        # a shorter window holds fewer steps: the prior is worth as much less
        local = LOCAL_PRIOR * self.window / ACCEPTANCE_WINDOW
        prior, weight = (self.prior.share(), local) if self.prior is not None else (0.5, PRIOR)
        return (self.matched + weight * prior) / (self.steps + weight)

    def tokens(self, heads_tokens: float) -> float:
        """A sequence's tokens per speculative step: a lookup's where it drafts, else what the
        heads' drafts yield (`heads_tokens`; 1.0 without heads)."""
        share = self.share()
        return share * self.acceptance.tokens(LOOKUP_DRAFTS) + (1.0 - share) * heads_tokens


LOOKUP_MIN, LOOKUP_MAX = 2, 4
"""The n-gram lengths `PromptLookup` matches, the longest first (a single token's last occurrence
predicts what follows it far worse than two tokens' does)."""
LOOKUP_DRAFTS = 4
"""The drafts a lookup proposes, whatever the heads' depth: they cost no heads, and a verified row
about a twentieth of a plain step at batch 1."""


class PromptLookup:
    """Drafts copied from a request's own context (prompt lookup): where its last n tokens occurred
    before (n from `LOOKUP_MAX` down to `LOOKUP_MIN`, the latest occurrence), the tokens that
    followed them there, and where those reach the end of the context, the same again (a text
    that repeats with that period goes on repeating). An agent's turns quote the files, tool
    outputs and earlier turns in their context, so the model often repeats a stretch it has seen;
    such drafts cost no heads at all, and a model without heads can speculate with them. Every
    n-gram's latest occurrence is kept in a dict, indexed as the context grows: a proposal costs a
    few lookups, the whole prompt is indexed once."""

    def __init__(self) -> None:
        self._follows: dict[tuple[int, ...], int] = {}   # n-gram -> where what followed its latest occurrence starts
        self._indexed = 0   # the n-grams ending before this position are in `_follows`

    def propose(self, context: list[int], depth: int) -> list[int]:
        """Up to `depth` tokens that followed the longest repeated suffix of `context` (none: no
        suffix of `LOOKUP_MIN` tokens or more occurred before)."""
        end = len(context)
        for at in range(max(self._indexed, LOOKUP_MIN), end):   # the suffix itself (at == end) stays out
            for n in range(LOOKUP_MIN, min(LOOKUP_MAX, at) + 1):
                self._follows[tuple(context[at - n:at])] = at
        self._indexed = max(self._indexed, end)
        for n in range(min(LOOKUP_MAX, end), LOOKUP_MIN - 1, -1):
            at = self._follows.get(tuple(context[end - n:]))
            if at is not None:   # past the end, the repeat runs on: a cycle drafts a whole depth
                return [context[at + i % (end - at)] for i in range(depth)]
        return []


@dataclass
class _Bucket:
    """What the policy knows of one batch size (a power of two): see `SpeculationPolicy`."""

    acceptance: Acceptance
    lookups: "LookupYield | None" = None                 # what lookup drafts yield (None: no lookup)
    current: int = 0                                   # the drafts a step verifies now (0: plain steps)
    costs: dict[int, deque] = field(default_factory=dict)   # per depth: seconds per sequence-step, last steps
    countdown: int = WARM_STEPS                        # current-kind steps until the next probe
    gap: int = FIRST_GAP // 2
    probing: int | None = None                         # the depth a running probe measures
    probe_left: int = 0
    judged: int | None = None                          # a finished probe's depth, waiting for ...
    judge_left: int = 0                                # ... this many more current-kind steps
    chained: int = 0                                   # probes a decision has sent on to the next
    drifted: bool = False                              # the running probe came of a drift, not when due
    yield_then: float = 1.0                            # the current depth's tokens a step, when chosen
    deepest_then: float = float("inf")                 # ... and the deepest kind's (none before the first)
    steps: int = 0                                     # steps taken at this batch size
    measured: dict[int, int] = field(default_factory=dict)  # per depth: `steps` when last measured


class SpeculationPolicy:
    """How many drafts the next step verifies, 0 for a plain step (see the module docstring):
    `choose(batch)` before a step, `observe(drafted, accepted)` for each sequence it verified,
    `record(depth, batch, seconds)` after it. `depth`: the heads (0: never speculate); `max_batch`:
    no speculation above it; `lookup`: sequences may draft by lookup instead (`LookupYield`: a
    speculative step's tokens are then a lookup's where contexts repeat, the heads' elsewhere, and
    without heads its one speculative kind is depth 1). `mode` "auto" measures; "always" (every
    head's draft) and "never" fix the choice (what a benchmark compares).

    A kind of step is judged by its seconds per emitted token: its cost (seconds per
    sequence-step, the mean of its last steps at this batch size, outliers left out) over the
    tokens a sequence's step of it emits, which come from the heads' acceptance (`Acceptance`,
    over every verified draft, so far less noisy than one probe's tokens). A speculative step costs more and only
    acceptance pays for it; a deeper step costs more again, and its last heads are the ones that
    guess worst. Depths never measured cost what the measured ones on either side say, in a line.

    Each batch size starts with plain steps, the kind that cannot lose. After `WARM_STEPS` of them
    the first probe runs every head (measuring all their acceptances), a few steps long (more at
    batch 1, where one step's tokens vary most); then the kind with the fewest seconds per token
    becomes current if it beats the current one by `GAIN` (`DEPTH_GAIN` between two depths that
    both speculate, `RETURN_GAIN` for plain steps replacing speculation: the kind that cannot
    lose comes back at a smaller loss than the one speculation must win by to replace it). A
    step's cost moves with its sequences' lengths, so a cost from another workload (long agent contexts, then short chat
    replies) would decide a switch wrongly: a probe is judged against the current kind's steps
    just before and just after it, as many of each as it has (as a benchmark interleaves), and a
    switch weighs only costs measured within `FRESH` steps of each other; a depth that only a line
    through those says is best is probed first. Later probes measure, of the kinds near the current one, the one
    measured longest ago (see `_next_probe`); and where the heads come to guess worse than when
    the current depth was chosen (RL moved the policy), a probe comes at once. Gaps
    between probes count that batch size's own steps (not seconds: what else the engine ran in
    between says nothing of this batch size): after a switch the next probe comes `FIRST_GAP`
    steps later; a probe that loses doubles the gap (multiplies it by 8 where speculation lost to
    plain steps by `FAR`: that far from paying, soon again would be waste) up to `LAST_GAP`; one
    the drift brought leaves it as it was (the drift may go on, and the due probes still come). A
    probe also costs more than its steps: the heads first catch up on the positions decoded
    without them (up to `MAX_BACKLOG` of a new request's prompt). So where speculation does not
    pay it costs a few steps in a thousand, and where it does it is on within a few dozen steps,
    at the depth that pays best."""

    MODES = ("auto", "always", "never")

    def __init__(self, depth: int, max_batch: int, lookup: bool = False) -> None:
        self.heads = depth
        self.depth, self.max_batch = max(depth, 1) if lookup else depth, max_batch
        self.mode = "auto"
        self.acceptance = Acceptance(depth)
        self.lookups = LookupYield() if lookup else None
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0
        self.chosen: Counter[int] = Counter()    # steps taken at each depth

    @property
    def enabled(self) -> bool:
        return self.depth > 0

    @staticmethod
    def bucket(batch: int) -> int:
        return max(1, batch).bit_length()

    @staticmethod
    def probe_steps(batch: int) -> int:
        return max(MIN_PROBE_STEPS, -(-PROBE_STEPS // max(1, batch)))

    @staticmethod
    def typical_cost(costs) -> float:
        """The mean of `costs` that are at most `OUTLIER` times their median (0.0 for none): a
        step that built a kernel (a new shape's first) takes seconds, and one such step, or a few
        the machine's other work slowed, would decide a probe. Not the median itself: a kind's
        steps differ where only some sequences drafted (lookup finds a repeat in a few contexts,
        and those steps verify more rows), and the median step is then one that drafted least."""
        if not costs:
            return 0.0
        median = statistics.median(costs)
        return statistics.fmean(c for c in costs if c <= OUTLIER * median)

    def current(self, batch: int) -> int:
        """The depth steps at `batch` take now (auto mode, outside probes)."""
        return self._buckets[self.bucket(batch)].current if self.bucket(batch) in self._buckets else 0

    def speculating(self, batch: int) -> bool:
        """Whether a step at `batch` would speculate now (without counting it as taken)."""
        return self._choose(batch) > 0

    def may_speculate(self, batch: int) -> bool:
        """Whether steps at `batch` could speculate (so the heads should follow them): not where
        the heads are off or `batch` is above `max_batch`."""
        return self.enabled and self.mode != "never" and (self.mode == "always" or batch <= self.max_batch)

    def choose(self, batch: int) -> int:
        depth = self._choose(batch)
        self.chosen[depth] += 1
        return depth

    def _choose(self, batch: int) -> int:
        if not self.enabled or self.mode == "never":
            return 0
        if self.mode == "always":
            return self.depth
        if batch > self.max_batch:
            return 0
        state = self._state(batch)
        return state.current if state.probing is None else state.probing

    def observe(self, batch: int, drafted: int, accepted: int, looked_up: bool = False) -> None:
        """One sequence's verification in a step of `batch` sequences (see `Acceptance.observe`):
        of the heads' drafts, or (`looked_up`) a lookup's. With lookup on, every speculating
        sequence-step counts towards how often a lookup drafts."""
        state = self._state(batch)
        if self.lookups is not None:
            self.lookups.observe(drafted, accepted, looked_up)
            state.lookups.observe(drafted, accepted, looked_up)
        if drafted > 0 and not looked_up:
            self.acceptance.observe(drafted, accepted)
            state.acceptance.observe(drafted, accepted)

    def observe_repeats(self, batch: int, repeats: int) -> None:
        """A plain step of `batch` sequences, `repeats` of whose contexts held a repeat a lookup
        would have drafted from: this batch size's lookup share follows its text while it takes
        plain steps, and a turn to text that repeats itself brings a probe."""
        if self.lookups is None:
            return
        state = self._state(batch)
        for b in range(batch):
            self.lookups.observe_share(b < repeats)
            state.lookups.observe_share(b < repeats)

    def tokens(self, batch: int, depth: int) -> float:
        """A sequence's expected tokens per step at `depth` (0: a plain step's one)."""
        return self._tokens(self._state(batch), depth)

    def _tokens(self, state: _Bucket, depth: int) -> float:
        if depth == 0:
            return 1.0
        heads = state.acceptance.tokens(min(depth, self.heads))
        return heads if state.lookups is None else state.lookups.tokens(heads)

    def _state(self, batch: int) -> _Bucket:
        key = self.bucket(batch)
        if key not in self._buckets:
            lookups = LookupYield(prior=self.lookups, window=SHARE_WINDOW) if self.lookups is not None else None
            self._buckets[key] = _Bucket(Acceptance(self.heads, prior=self.acceptance), lookups)
        return self._buckets[key]

    def record(self, depth: int, batch: int, seconds: float) -> None:
        if not self.enabled or self.mode != "auto" or batch > self.max_batch:
            return
        state = self._state(batch)
        state.steps += 1
        if depth == state.probing:
            state.costs[depth].append(seconds / max(1, batch))
            state.measured[depth] = state.steps
            state.probe_left -= 1
            if state.probe_left <= 0:   # judged once as many current steps followed as preceded it
                state.probing, state.judged, state.judge_left = None, depth, self.probe_steps(batch)
        elif depth == state.current:
            state.costs.setdefault(depth, deque(maxlen=COMPARED)).append(seconds / max(1, batch))
            state.measured[depth] = state.steps
            if state.judged is not None:
                state.judge_left -= 1
                if state.judge_left <= 0:
                    judged, state.judged = state.judged, None
                    self._decide(state, batch, judged)
                return
            state.countdown -= 1
            if self._tokens(state, depth) < GAIN * state.yield_then or \
                    depth == 0 and GAIN * self._tokens(state, self.depth) > state.deepest_then:
                # the heads guess worse than when this depth was chosen, or (on plain steps) the
                # contexts came to repeat themselves far more: now
                state.countdown = 0
                state.drifted = True
            if state.countdown <= 0:
                self._probe(state, batch, self._next_probe(state))

    def _next_probe(self, state: _Bucket) -> int:
        """The kind a due probe measures: the most promising where it looks faster than the current
        one (by what was measured, however long ago, or a line through it); else, of the kinds not
        `FAR` from the current one, the one measured longest ago (a kind measured once, early or on
        a bad few steps, is not judged on that forever); else the most promising."""
        # a depth nothing says anything of is worth measuring: 0.0, the most promising
        estimates = {d: v or 0.0 for d, v in self._per_token(state).items()}
        others = sorted((d for d in estimates if d != state.current), key=lambda d: (estimates[d], -d))
        if self._beats(estimates, others[0], state.current):
            return others[0]
        near = [d for d in others if d in state.measured and estimates[d] <= FAR * estimates[state.current]]
        return min(near, key=lambda d: state.measured[d]) if near else others[0]

    def _probe(self, state: _Bucket, batch: int, depth: int) -> None:
        state.probing, state.probe_left = depth, self.probe_steps(batch)
        state.costs[depth] = deque(maxlen=COMPARED)

    def _decide(self, state: _Bucket, batch: int, probed: int) -> None:
        fresh = {d for d, at in state.measured.items() if at >= state.steps - FRESH}
        known = self._per_token(state, fresh, last=2 * self.probe_steps(batch))
        estimates = {d: v for d, v in known.items() if v is not None}
        best = self._fastest(estimates, estimates)
        if self._beats(estimates, best, state.current):
            if best not in fresh and state.chained < self.depth:
                # only a line through what was just measured says so: measure it (a few at most,
                # or costs that are no line could send the probes from depth to depth)
                state.chained += 1
                self._probe(state, batch, best)
                return
            if best not in fresh:
                best = self._fastest(estimates, fresh)
        state.chained = 0
        if self._beats(estimates, best, state.current):
            state.current = best
            self.switches += 1
            state.gap = state.countdown = FIRST_GAP
        else:
            # far from paying, speculation is not soon worth another look; but a depth that lost
            # to another depth says nothing of plain steps, which the next probe may well measure
            ratio = estimates[probed] / max(estimates[state.current], 1e-12)
            far = ratio > FAR and state.current == 0
            # a probe the heads' drift brought early says less than a due one: the drift may go on,
            # so the due probes keep their gap
            grow = 1 if state.drifted else 8 if far else 2
            state.gap = state.countdown = min(LAST_GAP, grow * state.gap)
        state.drifted = False
        state.yield_then = self._tokens(state, state.current)
        state.deepest_then = self._tokens(state, self.depth)

    @staticmethod
    def _fastest(estimates: dict[int, float], among) -> int:
        """The depth of `among` with the fewest seconds per token (the deeper one of a tie)."""
        return min((d for d in estimates if d in among), key=lambda d: (estimates[d], -d))

    def _beats(self, estimates: dict[int, float], depth: int, current: int) -> bool:
        """Whether `depth` is enough faster than `current` to replace it (`_gain`)."""
        return depth != current and estimates[depth] < self._gain(depth, current) * estimates[current]

    @staticmethod
    def _gain(depth: int, current: int) -> float:
        """The share of the current kind's seconds per token `depth` must come under to replace it:
        a smaller margin between two speculative depths, whose costs were measured side by side
        and whose tokens come from the same acceptance, than between speculating and not; and a
        smaller one still for plain steps to replace speculation. The margins differ so that a
        kind does not flip back and forth on noise; they are uneven because speculation that
        loses a little (less than `GAIN`) would otherwise stay, and "never slower than plain
        steps" matters more than a small gain."""
        if depth == 0:
            return RETURN_GAIN
        return DEPTH_GAIN if current else GAIN

    def _per_token(self, state: _Bucket, among: set[int] | None = None, last: int = COMPARED
                   ) -> dict[int, float | None]:
        """Seconds per emitted token of every depth 0..D at this batch size: measured costs (over
        each depth's `last` steps, of the depths `among` only where given), and a line through the
        nearest measured depths where a depth has none (a deeper step costs no less than the
        deepest measured below it); None where no line reaches it."""
        measured = {d: self.typical_cost(list(c)[-last:]) for d, c in state.costs.items()
                    if c and (among is None or d in among)}
        out = {}
        for depth in range(self.depth + 1):
            cost = measured.get(depth)
            if cost is None:
                below = [d for d in measured if d < depth]
                above = [d for d in measured if d > depth]
                if below and above:
                    lo, hi = max(below), min(above)
                elif len(below) >= 2:
                    lo, hi = sorted(below)[-2:]
                else:
                    out[depth] = None
                    continue
                cost = measured[lo] + (measured[hi] - measured[lo]) * (depth - lo) / (hi - lo)
                if not above:
                    cost = max(cost, measured[hi])
            out[depth] = cost / self._tokens(state, depth)
        return out
