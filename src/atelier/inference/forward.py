"""A batched Llama-family forward pass over a paged (block) KV cache.

The engine's scheduler needs two operations that Hugging Face's `forward`
with a `DynamicCache` makes awkward: *prefill* a few new sequences while
others are mid-generation, and *decode* one token for every running sequence
at once, each at its own position. This module runs the model's own
submodules (embeddings, RMSNorms, projections, MLPs, rotary embedding, LM
head: so the weights and any `update_weights` live in the HF model) and does
only the attention and the cache itself.

Cache layout (`PagedKV`): one tensor each for keys and values,
`[L, Hkv, R, D]` with R = P * S rows, P blocks of S positions, allocated once
at the engine's budget. A sequence's positions live in the blocks of its
*block table* (position p in row `table[p // S] * S + p % S`); which blocks a
sequence owns is the engine's business (`prefix_cache.BlockPool`, which hands
a sequence consecutive blocks when it can). Prefill runs all new tokens of all
sequences as one flat batch (no padding) and attends per sequence; decode
attends per sequence too, straight from the pool.

Decode attention reads the cache in place: one head's keys of consecutive
blocks are one contiguous `[T, D]` stretch of the pool (head-major layout), so
for a sequence whose blocks are consecutive (what the pool's allocator aims
for) attention is two matrix products and a softmax over views, with nothing
padded to the longest sequence and no copy of the cache. A table of a few
runs (a shared prefix-cache prefix, then the sequence's own blocks) is joined
into one buffer, many runs are gathered in one op; either way the keys are
laid out as for one run, so a request's logprobs do not depend on where its
blocks happen to be. Scores and values are fp32: bf16 keys are widened as
they are read, which was faster here than bf16 products for 3 query rows per
head, and more exact. Each row's attention depends on its own sequence only.

Shared prompts (cascade attention): an agent's sequences begin with the same
system prompt, and the prefix cache gives them the same blocks for it. Decode
finds the sequences whose tables begin with the same blocks
(`shared_prefixes`) and attends all their queries to those keys in one
product, so the shared keys are read once a step instead of once per
sequence; each sequence attends to its own positions on its own, and the two
parts are joined through their softmax maxima and sums (exact up to
rounding: the logits move as much as batching moves them). On the demo's
rollouts 1,216 of ~1,950 positions are shared.

Measured on SmolLM2-135M in bf16, batch 16 at ~3k positions, CPU time per
layer on this 2-core machine: the earlier design (gather every block table
into a padded `[B, Hkv, T, D]` copy, then one masked
`scaled_dot_product_attention`) took 92 ms, 17 of them the gather and most of
the rest SDPA's CPU kernel, which is slow for one query position; products
over views take 22 ms.

Cost per decoder layer and step (what makes a step cheap on a CPU, where
every multi-threaded op pays a synchronisation however small it is): q/k/v
and gate/up run as one matmul each over fused weights whose slices *are* the
model's parameters (so `update_weights` needs no extra step), RMSNorm is one
fused op, and the new keys and values go into the cache with one `index_copy_`
each (advanced-index assignment was ~100x slower).

Shape legend: B batch (sequences), N new tokens in a prefill (all sequences, flat),
T key positions, L layers, P pool blocks, S positions per block, R = P * S pool
rows, H query heads, Hkv key/value heads, G = H / Hkv query heads per key/value
head, X = H + 2 Hkv fused q/k/v heads, D head dim, M model width, V vocabulary.

Supported: `model_type` in `SUPPORTED_TYPES` (Llama, Mistral and Mixtral
without a sliding window, Qwen2). Others raise `UnsupportedModel` when
loaded. A mixture-of-experts layer (Mixtral's) runs the model's own sparse
block on the normed hidden states, so router hooks (atelier.moe.replay) and
low-precision experts (atelier.moe.precision) apply to the engine too.

Routes (router replay's sampler side): on an MoE model, every forward also
writes the top-k expert ids each layer's router chose for each computed
position into `PagedKV.routes_RLk`, a row per KV position (R = P * S), -1
where nothing was computed. Routes live where the keys and values live, so
a prefix-cache hit brings back the experts that computed the cached keys,
and `routes(table, n)` gives a sequence's experts for positions 0..n-1
(what the sampler used for every token it fed).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from atelier.errors import AtelierError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "mixtral")
MAX_RUNS = 4
"""Attention over a block table of more runs than this gathers its rows in one op instead."""
MIN_SHARED_BLOCKS = 4
"""Decode attends over a prefix that several sequences share once for all of them when it is at
least this many blocks long (see `shared_prefixes`)."""


@contextlib.contextmanager
def threads(n: int):
    """Run the block with torch on `n` threads in the calling thread (torch's thread count is per
    thread, so other threads, e.g. a trainer's, keep theirs)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class UnsupportedModel(AtelierError):
    """The local engine has no batched forward for this architecture."""


def _rotate(x_BHTD: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it: x * cos + rotate_half(x) * sin.

    `sin_B1TD` comes with its first half negated, so rotate_half(x) * sin is
    roll(x, D/2) * sin: the same products, two ops fewer.
    """
    return x_BHTD * cos_B1TD + torch.roll(x_BHTD, x_BHTD.shape[-1] // 2, dims=-1) * sin_B1TD


def _norm(norm, x_BTM: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm in one fused op (Hugging Face's computes it in fp32, then scales)."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    if x_BTM.dtype == torch.float32:
        return F.rms_norm(x_BTM, (x_BTM.shape[-1],), norm.weight, eps)
    return norm.weight * F.rms_norm(x_BTM.float(), (x_BTM.shape[-1],), eps=eps).to(x_BTM.dtype)


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _fuse(module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `module`'s linears `names` into one tensor and make
    each linear's parameters views into it: one matmul instead of several, no extra memory, and
    writes into the model's own parameters (`update_weights`) land in the fused tensor."""
    linears = [getattr(module, n) for n in names]
    fused = []
    for attr in ("weight", "bias"):
        parts = [getattr(lin, attr) for lin in linears]
        if all(p is None for p in parts):
            fused.append(None)
            continue
        whole = torch.cat([p.detach() for p in parts])
        offset = 0
        for lin, p in zip(linears, parts):
            setattr(lin, attr, torch.nn.Parameter(whole[offset:offset + p.shape[0]], requires_grad=False))
            offset += p.shape[0]
        fused.append(whole)
    return fused[0], fused[1]


def shared_prefixes(tables: list[list[int]], positions: list[int], block: int) -> list[tuple[list[int], int]]:
    """Sequences of a decode batch whose block tables begin with the same blocks (prefix-cache
    hits on one prompt, such as an agent's system prompt), as `(members, blocks shared)`: groups
    of at least two sharing at least `MIN_SHARED_BLOCKS` blocks, each below every member's current
    block (the one its new key goes into)."""
    by_first: dict[int, list[int]] = {}
    for b, (table, position) in enumerate(zip(tables, positions)):
        if position // block >= MIN_SHARED_BLOCKS:
            by_first.setdefault(table[0], []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = tables[members[0]]
        limit = min(positions[b] // block for b in members)
        shared = 0
        while shared < limit and all(tables[b][shared] == first[shared] for b in members):
            shared += 1
        if shared >= MIN_SHARED_BLOCKS:
            groups.append((members, shared))
    return groups


def runs(table: list[int], n: int, block: int) -> list[tuple[int, int]]:
    """Positions `0:n` of a sequence with block table `table` as `(first row, length)` runs of
    consecutive pool rows: one run when its blocks are consecutive, one per jump otherwise."""
    out: list[tuple[int, int]] = []
    for j in range((n + block - 1) // block):
        length = min(block, n - j * block)
        row = table[j] * block
        if out and out[-1][0] + out[-1][1] == row:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((row, length))
    return out


class PagedKV:
    """Keys and values of every layer in `blocks` blocks of `block` positions: the engine's whole
    KV memory, allocated once (zeroed, so any block is safe to read).

    Layout `[L, Hkv, R, D]`, row `b * S + o` for offset o of block b: one head's keys of
    consecutive blocks are one contiguous `[T, D]` stretch, so attention over a run of a block
    table reads the pool in place (see the module docstring).
    """

    @torch.inference_mode()
    def __init__(self, layers: int, blocks: int, block: int, kv_heads: int, head_dim: int, dtype, device,
                 routes: tuple[int, int] | None = None) -> None:
        shape = (layers, kv_heads, blocks * block, head_dim)
        self.block = block
        self.k_LHRD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LHRD = torch.zeros(shape, dtype=dtype, device=device)
        # MoE only: (moe layers, k) -> int16 expert ids per position row, -1 = not computed
        self.routes_RLk = None if routes is None else torch.full((blocks * block, *routes), -1, dtype=torch.int16,
                                                                  device=device)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.routes_RLk is None else self.routes_RLk.numel() * 2
        return 2 * self.k_LHRD.numel() * self.k_LHRD.element_size() + extra

    def rows(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat position rows (block * S + offset) of positions `start:end` of a sequence."""
        S = self.block
        return [table[p // S] * S + p % S for p in range(start, end)]


class BatchedForward:
    """Prefill and decode over a Hugging Face Llama-family causal LM, keys and values in a `PagedKV`."""

    def __init__(self, hf_model, kv_blocks: int, block: int, cascade: bool = True) -> None:
        config = hf_model.config
        if config.model_type not in SUPPORTED_TYPES or getattr(config, "sliding_window", None) and \
                config.model_type in ("mistral", "mixtral"):
            raise UnsupportedModel(
                f"the local engine does not support model type {config.model_type!r}",
                hint=f"use a model of type {', '.join(SUPPORTED_TYPES)}, or serve this one with "
                     "another OpenAI-compatible server and pass its URL",
            )
        self.model = hf_model
        self.cascade = cascade   # shared prefixes attended once per decode step (`shared_prefixes`)
        self.core = hf_model.model
        self.layers = list(self.core.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        if any(getattr(layer.self_attn.q_proj, "bias", None) is not None and
               getattr(layer.self_attn.k_proj, "bias", None) is None for layer in self.layers):
            raise UnsupportedModel("the local engine expects q, k and v projections to all have a bias or none")
        with torch.no_grad():
            self.qkv = [_fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
            self.gate_up = [None if _is_moe(layer.mlp) else _fuse(layer.mlp, ("gate_proj", "up_proj"))
                            for layer in self.layers]
        param = next(hf_model.parameters())
        self.router = None
        self.stats = {"copied_rows": 0,    # see _keys
                      "shared_rows": 0}    # key positions decode attended once for a group (shared_prefixes)
        if not all(g is not None for g in self.gate_up):
            from atelier.moe.replay import RouterReplay

            self.router = RouterReplay(hf_model)   # observes only: what each router chose, per call
        routes = None if self.router is None else (self.router.num_layers, self.router.top_k)
        self.kv = PagedKV(len(self.layers), kv_blocks, block, self.kv_heads, self.head_dim,
                          param.dtype, param.device, routes)

    @staticmethod
    def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
        """What one token position costs in the KV pool: keys and values of every layer."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize

    @property
    def device(self) -> torch.device:
        return self.kv.k_LHRD.device

    def _rope(self, x_BTM: torch.Tensor, pos_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_BTD, sin_BTD = self.core.rotary_emb(x_BTM, pos_BT)
        half = self.head_dim // 2
        sin_BTD = torch.cat((-sin_BTD[..., :half], sin_BTD[..., half:]), dim=-1)
        return cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)

    def _layers(self, x_BTM: torch.Tensor, pos_BT: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer; `attend(i, q, k, v)` stores k and v and returns attention [B, H, T, D]."""
        B, T, _ = x_BTM.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        cos, sin = self._rope(x_BTM, pos_BT)
        for i, layer in enumerate(self.layers):
            qkv_BTX = F.linear(_norm(layer.input_layernorm, x_BTM), *self.qkv[i])
            qkv_BXTD = qkv_BTX.view(B, T, H + 2 * Hkv, D).transpose(1, 2)
            qk = _rotate(qkv_BXTD[:, : H + Hkv], cos, sin)
            o_BHTD = attend(i, qk[:, :H], qk[:, H:], qkv_BXTD[:, H + Hkv:])
            x_BTM = x_BTM + layer.self_attn.o_proj(o_BHTD.transpose(1, 2).reshape(B, T, H * D))
            if self.gate_up[i] is None:   # sparse MoE block
                x_BTM = x_BTM + layer.mlp(_norm(layer.post_attention_layernorm, x_BTM))
                continue
            gate, up = F.linear(_norm(layer.post_attention_layernorm, x_BTM), *self.gate_up[i]).chunk(2, dim=-1)
            x_BTM = x_BTM + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return x_BTM

    def _record_routes(self, rows_N: torch.Tensor) -> None:
        """Store the experts the routers just chose for the N computed positions at their KV rows."""
        if self.router is not None:
            self.kv.routes_RLk.index_copy_(0, rows_N, self.router.used().to(torch.int16))

    def routes(self, table: list[int], n: int) -> torch.Tensor | None:
        """int64 [n, L, k]: the experts of positions 0..n-1 of the sequence with block table `table`
        (-1 where a position was never computed); None for a dense model."""
        if self.router is None:
            return None
        rows = torch.tensor(self.kv.rows(table, 0, n), dtype=torch.long, device=self.device)
        return self.kv.routes_RLk[rows].long().cpu()

    def _logits(self, h_BM: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_norm(self.core.norm, h_BM)).float()

    def _store(self, i: int, rows_N: torch.Tensor, k_HND: torch.Tensor, v_HND: torch.Tensor) -> None:
        self.kv.k_LHRD[i].index_copy_(1, rows_N, k_HND)
        self.kv.v_LHRD[i].index_copy_(1, rows_N, v_HND)

    def _plan(self, table: list[int], n: int) -> list[tuple[int, int]] | torch.Tensor:
        """Where positions `0:n` of a sequence live: its runs, or (past `MAX_RUNS`) its rows."""
        spans = runs(table, n, self.kv.block)
        if len(spans) <= MAX_RUNS:
            return spans
        return torch.cat([torch.arange(r, r + k) for r, k in spans]).to(self.device)

    def _keys(self, i: int, plan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values `[Hkv, T, D]` of a planned sequence, in `dtype`: a view of the
        pool when its blocks are one run (and `dtype` is the cache's), else one copy, laid out the
        same whatever the runs, so the values and the products over them are the same bit for bit.
        `stats["copied_rows"]` counts the rows copied because a table was not one run."""
        k_HRD, v_HRD = self.kv.k_LHRD[i], self.kv.v_LHRD[i]
        if isinstance(plan, torch.Tensor):
            self.stats["copied_rows"] += plan.numel()
            return k_HRD.index_select(1, plan).to(dtype), v_HRD.index_select(1, plan).to(dtype)
        if len(plan) == 1:
            r, n = plan[0]
            return k_HRD[:, r:r + n].to(dtype), v_HRD[:, r:r + n].to(dtype)
        T = sum(n for _, n in plan)
        self.stats["copied_rows"] += T
        k_HTD = k_HRD.new_empty((k_HRD.shape[0], T, k_HRD.shape[2]), dtype=dtype)
        v_HTD = torch.empty_like(k_HTD)
        at = 0
        for r, n in plan:
            k_HTD[:, at:at + n].copy_(k_HRD[:, r:r + n])
            v_HTD[:, at:at + n].copy_(v_HRD[:, r:r + n])
            at += n
        return k_HTD, v_HTD

    @staticmethod
    def _attend_one(q_HGD: torch.Tensor, k_HTD: torch.Tensor, v_HTD: torch.Tensor) -> torch.Tensor:
        """One sequence's attention for its G query heads per key/value head, all fp32 (q scaled)."""
        return torch.matmul(torch.softmax(torch.matmul(q_HGD, k_HTD.transpose(1, 2)), dim=-1), v_HTD)

    @staticmethod
    def _attend_part(q_HMD: torch.Tensor, k_HTD: torch.Tensor, v_HTD: torch.Tensor):
        """Attention of queries over some of their keys, unnormalised (fp32): the scores' max
        `[H, M, 1]`, the sum of exp(score - max) `[H, M, 1]` and the exp-weighted values `[H, M, D]`,
        so parts over disjoint keys join exactly (`_attend_cascade`)."""
        scores_HMT = torch.matmul(q_HMD, k_HTD.transpose(1, 2))
        top_HM1 = scores_HMT.amax(dim=-1, keepdim=True)
        weights_HMT = scores_HMT.sub_(top_HM1).exp_()
        return top_HM1, weights_HMT.sum(dim=-1, keepdim=True), torch.matmul(weights_HMT, v_HTD)

    def _attend_cascade(self, i: int, q_mHGD: torch.Tensor, shared, own: list) -> torch.Tensor:
        """Attention of m sequences whose first positions are the same blocks (`shared`, planned):
        every query against the shared keys in one product (the keys read once, not m times), each
        sequence's queries against its own positions (`own[j]`), the parts joined by their maxima
        and sums. Returns [m, Hkv, G, D], fp32."""
        m, Hkv, G, D = q_mHGD.shape
        top, total, out = self._attend_part(q_mHGD.transpose(0, 1).reshape(Hkv, m * G, D),
                                            *self._keys(i, shared, torch.float32))
        top, total, out = (t.view(Hkv, m, G, -1).transpose(0, 1) for t in (top, total, out))
        parts = [self._attend_part(q_mHGD[j], *self._keys(i, plan, torch.float32)) for j, plan in enumerate(own)]
        own_top, own_total, own_out = (torch.stack(t) for t in zip(*parts))
        peak = torch.maximum(top, own_top)
        scale, own_scale = torch.exp(top - peak), torch.exp(own_top - peak)
        return (out * scale + own_out * own_scale) / (total * scale + own_total * own_scale)

    @torch.inference_mode()
    def prefill(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Compute `tokens[start:]` of each `(tokens, start, table)` and store their keys and values
        through the block table `table`; return each sequence's last-position logits [B, V] (fp32).

        Positions before `start` must already be in the sequence's blocks (a prefix-cache hit or
        an earlier computation). The sequences' new tokens run as one flat batch (no padding) for
        every matrix multiply; attention runs per sequence: causal over its own new keys when it
        starts at 0, else over its blocks (in place when they are consecutive, else gathered).
        """
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        ids, pos, rows, spans = [], [], [], []
        for tokens, start, table in seqs:
            n = len(tokens) - start
            spans.append((len(ids), n, start, table))
            ids += tokens[start:]
            pos += range(start, len(tokens))
            rows += self.kv.rows(table, start, len(tokens))
        dev, dtype = self.device, self.core.embed_tokens.weight.dtype
        ids_1N = torch.tensor(ids, dtype=torch.long, device=dev)[None]
        pos_1N = torch.tensor(pos, dtype=torch.long, device=dev)[None]
        rows_N = torch.tensor(rows, dtype=torch.long, device=dev)
        plans = []
        for off, n, start, table in spans:
            if start == 0:
                plans.append((off, n, None, None))
                continue
            # Additive and [1, 1, N, T], made once for every layer: SDPA's fused CPU kernel takes a 4-D
            # mask only (a 3-D one sent it to the unfused path, which materialises and softmaxes every
            # [H, N, T] score: its attention ~10x slower here), and a boolean one it converts at every layer
            hidden = torch.arange(start + n, device=dev)[None, :] > torch.arange(start, start + n, device=dev)[:, None]
            mask_11NT = torch.zeros(hidden.shape, dtype=dtype, device=dev).masked_fill_(hidden, float("-inf"))
            plans.append((off, n, self._plan(table, start + n), mask_11NT[None, None]))

        def attend(i, q, k, v):
            self._store(i, rows_N, k[0], v[0])
            outs = []
            for off, n, plan, mask in plans:
                q_b = q[:, :, off:off + n]
                if plan is None:
                    out = F.scaled_dot_product_attention(q_b, k[:, :, off:off + n], v[:, :, off:off + n],
                                                         is_causal=True, scale=self.scaling, enable_gqa=True)
                else:
                    kg, vg = self._keys(i, plan, q.dtype)
                    out = F.scaled_dot_product_attention(q_b, kg[None], vg[None], attn_mask=mask,
                                                         scale=self.scaling, enable_gqa=True)
                outs.append(out)
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

        x_1NM = self._layers(self.core.embed_tokens(ids_1N), pos_1N, attend)
        self._record_routes(rows_N)
        last = torch.tensor([off + n - 1 for off, n, _, _ in plans], device=dev)
        return self._logits(x_1NM[0, last])

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One step for B sequences: token b sits at `positions[b]`, its keys and values go through
        block table `tables[b]` (which must cover that position). Returns next-token logits [B, V]
        (fp32).

        Attention runs per sequence over its own positions, read from the pool in place (runs of
        consecutive blocks; see the module docstring): nothing is padded or copied, and a prefix
        that several sequences share is attended once for all of them (`_attend_cascade`). It runs on one
        thread: it is many small products, one sequence at a time, and split over threads each
        pays a synchronisation that costs more than the work, far more when another process holds
        a core (measured here at batch 16, ~3k positions, load ~13: 23 ms of CPU per layer on
        one thread, 159 ms on two).
        """
        B = len(tokens)
        S = self.kv.block
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        dev = self.device
        ids_B1 = torch.tensor(tokens, dtype=torch.long, device=dev)[:, None]
        pos_B1 = torch.tensor(positions, dtype=torch.long, device=dev)[:, None]
        rows_B = torch.tensor([t[p // S] * S + p % S for t, p in zip(tables, positions)], dtype=torch.long,
                              device=dev)
        groups = shared_prefixes(tables, positions, S) if self.cascade else []
        in_group = {b for members, _ in groups for b in members}
        plans = [None if b in in_group else self._plan(t, p + 1) for b, (t, p) in enumerate(zip(tables, positions))]
        group_plans = [(members, self._plan(tables[members[0]], blocks * S),
                        [self._plan(tables[b][blocks:], positions[b] + 1 - blocks * S) for b in members])
                       for members, blocks in groups]
        self.stats["shared_rows"] += sum(blocks * S for _, blocks in groups)

        def attend(i, q, k, v):
            self._store(i, rows_B, k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1))
            q_BHGD = (q[:, :, 0].float() * self.scaling).view(B, Hkv, H // Hkv, D)
            outs: list[torch.Tensor | None] = [None] * B
            with threads(1):   # many small products: see `decode`
                for b, plan in enumerate(plans):
                    if plan is not None:
                        outs[b] = self._attend_one(q_BHGD[b], *self._keys(i, plan, torch.float32))
                for members, shared, own in group_plans:
                    for b, out in zip(members, self._attend_cascade(i, q_BHGD[members], shared, own)):
                        outs[b] = out
            return torch.stack(outs).view(B, H, 1, D).to(q.dtype)

        x_B1M = self._layers(self.core.embed_tokens(ids_B1), pos_B1, attend)
        self._record_routes(rows_B)
        return self._logits(x_B1M[:, 0])
