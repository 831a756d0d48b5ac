"""A batched Llama-family forward pass over a paged (block) KV cache.

The engine's scheduler needs two operations that Hugging Face's `forward`
with a `DynamicCache` makes awkward: *prefill* a few new sequences while
others are mid-generation, and *decode* one token for every running sequence
at once, each at its own position. This module runs the model's own
submodules (embeddings, RMSNorms, rotary embedding, MoE blocks) and its own
weights (so `update_weights` lands in the HF model), and does the matrix
products, the attention and the cache itself.

Cache layout (`PagedKV`): one tensor each for keys and values,
`[L, Hkv, R, D]` with R = P * S rows, P blocks of S positions, allocated once
at the engine's budget. A sequence's positions live in the blocks of its
*block table* (position p in row `table[p // S] * S + p % S`); which blocks a
sequence owns is the engine's business (`prefix_cache.BlockPool`, which hands
a sequence consecutive blocks when it can).

Prefill runs all new tokens of all sequences as one flat batch (no padding)
for every matrix product and attends per sequence with SDPA's fused kernel:
causal over its own new keys when it starts at 0, else over its blocks (read
in place when they are consecutive, gathered otherwise, so a request's
logprobs do not depend on where its blocks happen to be).

Decode runs the whole batch through every layer with no loop over sequences:
the batch is sorted by length and cut into groups of alike lengths, and each
group's attention is one call of `attention.PagedDecodeAttention` (a kernel
`torch.compile` builds, reading the cache in place through the block tables).
A decode step only reads the pool while it runs; the new keys and values of
every layer go in with one `index_copy_` each at the end.

Matrix products: q/k/v and gate/up run as one product each over fused weights
whose slices *are* the model's parameters (so `update_weights` needs no extra
step), and every product's weight is kept in the layout the CPU's matrix
library (oneDNN) computes from (`PackedLinear`), re-laid after every weight
update. On a CPU with bf16 units that halves the time of a small batch's
products, with the same bits as `F.linear`.

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

import logging
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from atelier.errors import AtelierError
from atelier.inference.attention import PagedDecodeAttention, decode_attention, is_compile_error, length_groups
from atelier.inference.sampling import most_likely, tempered
from atelier.inference.threads import threads  # noqa: F401  (re-exported: rl.run sets its threads with it)
from atelier.moe.replay import RouterReplay

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "mixtral")
MAX_RUNS = 4
"""Prefill attention over a block table of more runs than this gathers its rows in one op instead."""
PACK_BATCH = 64
"""The batch size oneDNN is told to lay packed weights out for; any batch size runs on them."""
SCORE_CHUNK = 256
"""Positions whose logits `score` holds at once."""


class UnsupportedModel(AtelierError):
    """The local engine has no batched forward for this architecture."""


def _rotate(x_BHTD: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it: x * cos + rotate_half(x) * sin.

    `sin_B1TD` comes with its first half negated, so rotate_half(x) * sin is
    roll(x, D/2) * sin: the same products, two ops fewer.
    """
    return x_BHTD * cos_B1TD + torch.roll(x_BHTD, x_BHTD.shape[-1] // 2, dims=-1) * sin_B1TD


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _norm(weight: torch.Tensor, eps: float, x_BTM: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm in one fused op (Hugging Face's computes it in fp32, then scales)."""
    if x_BTM.dtype == torch.float32:
        return F.rms_norm(x_BTM, (x_BTM.shape[-1],), weight, eps)
    return weight * F.rms_norm(x_BTM.float(), (x_BTM.shape[-1],), eps=eps).to(x_BTM.dtype)


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


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN computes from a packed copy of this weight: a CPU tensor in bf16 on a CPU
    with bf16 units (faster at small batches, bit for bit equal: see docs/log/2026-12-06-rollout-engine.md)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.library.custom_op("atelier::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over a weight packed by `PackedLinear`. An op of our own so that
    `torch.compile` calls it as it is: its own lowering of oneDNN's op expects weights it packed
    itself, as constants, which weights that `update_weights` changes cannot be."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class PackedLinear:
    """`F.linear(x, weight, bias)`, computed from a copy of `weight` in oneDNN's own layout where
    `can_pack` (else plainly). `weight` stays the model's tensor: after it changes, `refresh()`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self.refresh()

    def refresh(self) -> None:
        if not can_pack(self.weight):
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH)
        if self.packed is None:
            self.packed = packed
        else:   # in place: a compiled step keeps reading the same tensor
            self.packed.copy_(packed)

    @property
    def nbytes(self) -> int:
        """Bytes the packed copy holds (0 where nothing is packed)."""
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed, self.bias)


def _linear(module) -> PackedLinear:
    return PackedLinear(module.weight, module.bias)


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
    consecutive blocks are one contiguous `[T, D]` stretch, so prefill reads a run of a block
    table in place (see the module docstring).
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


class Layer(NamedTuple):
    """One decoder layer as the forward runs it: tensors, plain numbers and functions only, so that
    one compiled graph serves every layer of every engine of a model's shape."""

    input_norm: torch.Tensor       # RMSNorm weights
    post_norm: torch.Tensor
    eps: float
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear | None   # None: an MoE layer, `moe` is its sparse block
    down: PackedLinear | None
    act: Callable
    moe: torch.nn.Module | None


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    block: int


class FlatBatch(NamedTuple):
    """Tokens of several sequences as one row: ids and positions [1, N], pool rows [N], and per
    sequence `(offset, count, plan, mask)` (plan None: it starts at 0, attention is causal over its
    own tokens)."""

    ids_1N: torch.Tensor
    pos_1N: torch.Tensor
    rows_N: torch.Tensor
    plans: list


def block(layer: Layer, shape: Shape, x_BTM: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          attend) -> torch.Tensor:
    """One decoder layer; `attend(q, k, v)` keeps k and v and returns attention [B, H, T, D]."""
    B, T, _ = x_BTM.shape
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    qkv_BTX = layer.qkv(_norm(layer.input_norm, layer.eps, x_BTM))
    qkv_BXTD = qkv_BTX.view(B, T, H + 2 * Hkv, D).transpose(1, 2)
    qk = _rotate(qkv_BXTD[:, : H + Hkv], cos, sin)
    o_BHTD = attend(qk[:, :H], qk[:, H:], qkv_BXTD[:, H + Hkv:])
    x_BTM = x_BTM + layer.o(o_BHTD.transpose(1, 2).reshape(B, T, H * D))
    normed_BTM = _norm(layer.post_norm, layer.eps, x_BTM)
    if layer.moe is not None:
        return x_BTM + layer.moe(normed_BTM)
    gate, up = layer.gate_up(normed_BTM).chunk(2, dim=-1)
    return x_BTM + layer.down(layer.act(gate) * up)


def decode_layer(layer: Layer, shape: Shape, k_KRD: torch.Tensor, v_KRD: torch.Tensor, x_B1M: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, groups: list[tuple[torch.Tensor, torch.Tensor]],
                 attention: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of a decode step over a batch sorted longest first: the layer's output and its new
    keys and values [B, Hkv, D] (stored by the caller, after every layer). `groups`: each group's
    padded block tables, cached lengths and sibling rows (None: none; see `decode_attention`), in
    batch order; `attention`: `decode_attention` or a callable
    with its signature. What `torch.compile` compiles, once for all layers."""
    B = x_B1M.shape[0]
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    new: list[torch.Tensor] = []

    def attend(q, k, v):
        k_BHD, v_BHD = k[:, :, 0], v[:, :, 0]
        new.extend((k_BHD, v_BHD))
        q_BKGD = (q[:, :, 0].float() * shape.scaling).view(B, Hkv, H // Hkv, D)
        outs, start = [], 0
        for table, length, siblings in groups:
            end = start + table.shape[0]
            outs.append(attention(q_BKGD[start:end], k_BHD[start:end], v_BHD[start:end], k_KRD, v_KRD,
                                  table, length, shape.block, siblings))
            start = end
        out_BKGD = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out_BKGD.view(B, H, 1, D).to(q.dtype)

    x_B1M = block(layer, shape, x_B1M, cos, sin, attend)
    return x_B1M, new[0], new[1]


_compiled_decode_layer = None
RECOMPILE_LIMIT = 64
COMPILE_OPTIONS = {
    # Keep q (and any value a reduction reads) in a buffer: inlined, inductor recomputed q's rotary
    # embedding for every key position it attended to, which made the fused layer slower than eager.
    "realize_reads_threshold": 1,
    # Round intermediates to the model's dtype where eager does, so compiled and eager agree as
    # closely as two kernels can.
    "emulate_precision_casts": True,
}


def compile_for_every_shape(fn: Callable, **compile_kwargs: Any) -> Callable:
    """`torch.compile(fn)` with room for `RECOMPILE_LIMIT` graphs. The decode layer has one per
    thread count, batch of one or more, number of length groups, dtype and verification or plain
    step: past dynamo's default of 8 it would run uncompiled from then on. The limit goes with the
    compiled region, not in `torch._dynamo.config`, whose settings hold only for the thread that
    makes them: each engine runs on a thread of its own."""
    return torch.compile(fn, recompile_limit=RECOMPILE_LIMIT, **compile_kwargs)


def compiled_decode_layer() -> Callable:
    """`decode_layer` compiled, one wrapper for the process: its graphs serve every layer of every
    engine with the same shapes."""
    global _compiled_decode_layer
    if _compiled_decode_layer is None:
        _compiled_decode_layer = compile_for_every_shape(decode_layer, dynamic=False, options=COMPILE_OPTIONS)
    return _compiled_decode_layer


class BatchedForward:
    """Prefill and decode over a Hugging Face Llama-family causal LM, keys and values in a `PagedKV`.

    `extra_kv_layers` adds pool layers after the model's (the MTP heads' blocks keep their keys
    there, `speculative.DraftHeads`). `compile` (None: where a compiler is found) runs decode's
    layers as a kernel `torch.compile` builds (one graph serves every layer: compiling takes
    seconds, not minutes); False runs the same arithmetic eagerly (`attention.py`).
    """

    def __init__(self, hf_model, kv_blocks: int, block: int, compile: bool | None = None,
                 extra_kv_layers: int = 0) -> None:
        config = hf_model.config
        if config.model_type not in SUPPORTED_TYPES or getattr(config, "sliding_window", None) and \
                config.model_type in ("mistral", "mixtral"):
            raise UnsupportedModel(
                f"the local engine does not support model type {config.model_type!r}",
                hint=f"use a model of type {', '.join(SUPPORTED_TYPES)}, or serve this one with "
                     "another OpenAI-compatible server and pass its URL",
            )
        self.model = hf_model
        self.core = hf_model.model
        layers = list(self.core.layers)
        attn = layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        if any(getattr(layer.self_attn.q_proj, "bias", None) is not None and
               getattr(layer.self_attn.k_proj, "bias", None) is None for layer in layers):
            raise UnsupportedModel("the local engine expects q, k and v projections to all have a bias or none")
        with torch.no_grad():
            self.layers = [self._layer(layer, config) for layer in layers]
            self.lm_head = _linear(hf_model.lm_head)
        param = next(hf_model.parameters())
        self.router = None
        self.stats = {"copied_rows": 0,      # see _keys
                      "decode_groups": 0}    # attention calls decode made (length_groups), all layers as one
        if any(layer.gate_up is None for layer in self.layers):
            self.router = RouterReplay(hf_model)   # observes only: what each router chose, per call
        routes = None if self.router is None else (self.router.num_layers, self.router.top_k)
        # `extra_kv_layers`: pool layers past the model's, for the MTP heads' blocks (speculative.py)
        self.kv = PagedKV(len(self.layers) + extra_kv_layers, kv_blocks, block, self.kv_heads, self.head_dim,
                          param.dtype, param.device, routes)
        self.attention = PagedDecodeAttention(param.device, compile)
        self.shape = Shape(self.heads, self.kv_heads, self.head_dim, float(self.scaling), block)
        # A dense layer's decode is compiled whole (the elementwise work between the products
        # fused); an MoE block routes by data and runs hooks, so it stays eager around the
        # compiled attention kernel.
        self._compiled_layer = compiled_decode_layer() if self.attention.compiled else None

    @staticmethod
    def _layer(layer, config) -> Layer:
        moe = _is_moe(layer.mlp)
        act = F.silu if getattr(config, "hidden_act", None) == "silu" else getattr(layer.mlp, "act_fn", None)
        return Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, _eps(layer.input_layernorm),
                     PackedLinear(*_fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))),
                     _linear(layer.self_attn.o_proj),
                     None if moe else PackedLinear(*_fuse(layer.mlp, ("gate_proj", "up_proj"))),
                     None if moe else _linear(layer.mlp.down_proj), act, layer.mlp if moe else None)

    @property
    def linears(self) -> list[PackedLinear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
                if lin is not None] + [self.lm_head]

    def refresh_weights(self) -> None:
        """Re-lay the packed copies after the model's weights changed (`LocalEngine.update_weights`)."""
        with torch.no_grad():
            for lin in self.linears:
                lin.refresh()

    @property
    def packed_bytes(self) -> int:
        """Memory the packed weight copies hold, on top of the model's."""
        return sum(lin.nbytes for lin in self.linears)

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
        return self.lm_head(_norm(self.core.norm.weight, _eps(self.core.norm), h_BM)).float()

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

    def prefill(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Compute `tokens[start:]` of each `(tokens, start, table)` and store their keys and values
        through the block table `table`; return each sequence's last-position logits [B, V] (fp32).
        See `prefill_keeping`."""
        return self.prefill_keeping(seqs, [])[0]

    @torch.inference_mode()
    def prefill_keeping(self, seqs: list[tuple[list[int], int, list[int]]], keep: list[int]
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`prefill`, also returning the final hidden states [n, M] of the sequences at `keep`
        (indices into `seqs`), one row per computed position (what `score` turns into logprobs).

        Positions before `start` must already be in the sequence's blocks (a prefix-cache hit or
        an earlier computation). The sequences' new tokens run as one flat batch (no padding) for
        every matrix multiply; attention runs per sequence: causal over its own new keys when it
        starts at 0, else over its blocks (in place when they are consecutive, else gathered).
        """
        batch = self.flat_batch(seqs)
        x_1NM = self.run_layers(batch, self.core.embed_tokens(batch.ids_1N), enumerate(self.layers))
        self._record_routes(batch.rows_N)
        last = torch.tensor([off + n - 1 for off, n, _, _ in batch.plans], device=self.device)
        kept = [x_1NM[0, batch.plans[i][0]:batch.plans[i][0] + batch.plans[i][1]] for i in keep]
        return self._logits(x_1NM[0, last]), kept

    def flat_batch(self, seqs: list[tuple[list[int], int, list[int]]], unseen: list[int] | None = None
                   ) -> FlatBatch:
        """Positions `start:` of every `(tokens, start, table)` as one flat batch, with each
        sequence's attention plan (see `prefill_keeping`). `unseen[b]`: sequence b's positions
        before it are masked from its attention (keys never computed for the layers this batch
        runs: the MTP heads' of a prompt they skipped)."""
        ids, pos, rows, spans = [], [], [], []
        for b, (tokens, start, table) in enumerate(seqs):
            n = len(tokens) - start
            spans.append((len(ids), n, start, table, unseen[b] if unseen else 0))
            ids += tokens[start:]
            pos += range(start, len(tokens))
            rows += self.kv.rows(table, start, len(tokens))
        dev, dtype = self.device, self.core.embed_tokens.weight.dtype
        plans = []
        for off, n, start, table, before in spans:
            if start == 0:
                plans.append((off, n, None, None))
                continue
            # Additive and [1, 1, N, T], made once for every layer: SDPA's fused CPU kernel takes a 4-D
            # mask only (a 3-D one sent it to the unfused path, which materialises and softmaxes every
            # [H, N, T] score, far slower), and a boolean one it converts at every layer
            keys_T, queries_N = torch.arange(start + n, device=dev), torch.arange(start, start + n, device=dev)
            hidden = (keys_T[None, :] > queries_N[:, None]) | (keys_T < before)[None, :]
            mask_11NT = torch.zeros(hidden.shape, dtype=dtype, device=dev).masked_fill_(hidden, float("-inf"))
            plans.append((off, n, self._plan(table, start + n), mask_11NT[None, None]))
        return FlatBatch(torch.tensor(ids, dtype=torch.long, device=dev)[None],
                         torch.tensor(pos, dtype=torch.long, device=dev)[None],
                         torch.tensor(rows, dtype=torch.long, device=dev), plans)

    def run_layers(self, batch: FlatBatch, x_1NM: torch.Tensor, layers) -> torch.Tensor:
        """`x_1NM` through `(i, layer)` pairs in order, layer i's keys and values stored at the
        batch's rows of the pool's layer i and attended over as the batch's plans say."""
        def attend(i, q, k, v):
            self._store(i, batch.rows_N, k[0], v[0])
            outs = []
            for off, n, plan, mask in batch.plans:
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

        cos, sin = self._rope(x_1NM, batch.pos_1N)
        for i, layer in layers:
            x_1NM = block(layer, self.shape, x_1NM, cos, sin, partial(attend, i))
        return x_1NM

    @torch.inference_mode()
    def score(self, hidden_NM: torch.Tensor, targets: list[int], temperature: float, top: int
              ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """The logprob of `targets[i]` after the position whose hidden state is `hidden_NM[i]` (at
        `temperature`, as sampling defines logprobs), and the `top` most likely tokens there. The
        LM head runs over `SCORE_CHUNK` positions at a time, so a long prompt never holds its
        whole [N, V] logits."""
        logprobs: list[float] = []
        best: list[list[tuple[int, float]]] = []
        targets_N = torch.tensor(targets, dtype=torch.long)
        for at in range(0, hidden_NM.shape[0], SCORE_CHUNK):
            logits_CV = self._logits(hidden_NM[at:at + SCORE_CHUNK]).cpu()
            scaled_CV, lse_C = tempered(logits_CV, [temperature] * logits_CV.shape[0])
            chosen = targets_N[at:at + SCORE_CHUNK]
            logprobs += (scaled_CV.gather(1, chosen[:, None])[:, 0] - lse_C).tolist()
            if top:
                best += most_likely(scaled_CV, lse_C, top)
        return logprobs, best

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One step for B sequences: token b sits at `positions[b]`, its keys and values go through
        block table `tables[b]` (which must cover that position). Returns next-token logits [B, V]
        (fp32), row b for sequence b.

        The batch runs longest first, cut into groups of alike lengths (`length_groups`); each
        group's attention is one kernel call per layer over its padded block tables (see the module
        docstring). The new keys and values are stored after the last layer.
        """
        return self._logits(self._decode_rows(tokens, positions, tables))

    @torch.inference_mode()
    def decode_keeping(self, tokens: list[int], positions: list[int], tables: list[list[int]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode`, also returning the final hidden states [B, M] (the MTP heads' input)."""
        h_BM = self._decode_rows(tokens, positions, tables)
        return self._logits(h_BM), h_BM

    @torch.inference_mode()
    def verify(self, seqs: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions `start:` of each `(tokens, start, table)` (a speculative step's last token and
        drafts) computed as one decode step whose rows of a sequence see each other causally;
        returns every row's logits [N, V] (fp32) and final hidden states [N, M], sequence after
        sequence."""
        tokens, positions, tables, cached, seq_of = [], [], [], [], []
        for s, (toks, start, table) in enumerate(seqs):
            for p in range(start, len(toks)):
                tokens.append(toks[p])
                positions.append(p)
                tables.append(table)
                cached.append(start)
                seq_of.append(s)
        h_NM = self._decode_rows(tokens, positions, tables, cached, seq_of)
        return self._logits(h_NM), h_NM

    def _decode_rows(self, tokens: list[int], positions: list[int], tables: list[list[int]],
                     cached: list[int] | None = None, seq_of: list[int] | None = None) -> torch.Tensor:
        """The final hidden states [B, M] (caller's order) of a decode step: row b's token at
        `positions[b]` over the `cached[b]` positions its sequence has in the cache (default: all
        before it) and, with `seq_of`, the earlier rows of the same sequence."""
        B = len(tokens)
        S = self.kv.block
        dev = self.device
        cached = positions if cached is None else cached
        seq = seq_of or list(range(B))   # plain decode: every row a sequence of its own
        order = sorted(range(B), key=lambda b: (-cached[b], seq[b], positions[b]))
        lengths = [cached[b] for b in order]
        ids_B1 = torch.tensor([tokens[b] for b in order], dtype=torch.long, device=dev)[:, None]
        pos_B1 = torch.tensor([positions[b] for b in order], dtype=torch.long, device=dev)[:, None]
        len_B = torch.tensor(lengths, dtype=torch.long, device=dev)
        rows_B = torch.tensor([tables[b][positions[b] // S] * S + positions[b] % S for b in order],
                              dtype=torch.long, device=dev)
        groups = []
        for start, end in self._whole_sequences(length_groups(lengths), [seq[b] for b in order]):
            width = max(positions[b] for b in order[start:end]) // S + 1   # blocks of the group's longest past
            padded = [tables[b][:width] + [0] * (width - min(width, len(tables[b]))) for b in order[start:end]]
            siblings = None
            if seq_of is not None:
                ids = torch.tensor([seq[b] for b in order[start:end]], device=dev)
                at = pos_B1[start:end, 0]
                siblings = (ids[:, None] == ids[None, :]) & (at[None, :] <= at[:, None])
            groups.append((torch.tensor(padded, dtype=torch.long, device=dev), len_B[start:end], siblings))
        self.stats["decode_groups"] += len(groups)
        x_B1M = self.core.embed_tokens(ids_B1)
        cos, sin = self._rope(x_B1M, pos_B1)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x_B1M, k_BHD, v_BHD = self._decode_layer_call(layer, i, x_B1M, cos, sin, groups)
            new_k.append(k_BHD)
            new_v.append(v_BHD)
        self._store_all(rows_B, torch.stack(new_k), torch.stack(new_v))
        self._record_routes(rows_B)
        if order != list(range(B)):   # back to the caller's order, before the (wide) logits
            back = torch.empty(B, dtype=torch.long)
            back[torch.tensor(order)] = torch.arange(B)
            x_B1M = x_B1M[back.to(dev)]
        return x_B1M[:, 0]

    @staticmethod
    def _whole_sequences(groups: list[tuple[int, int]], seq: list[int]) -> list[tuple[int, int]]:
        """`groups` with every cut moved back to where its sequence's rows begin (a sequence's rows
        attend to each other, so they share a group)."""
        cuts = []
        for start, _ in groups:
            while 0 < start and seq[start - 1] == seq[start]:
                start -= 1
            if not cuts or start > cuts[-1]:
                cuts.append(start)
        return list(zip(cuts, cuts[1:] + [len(seq)]))

    def _decode_layer_call(self, layer: Layer, i: int, x_B1M, cos, sin, groups):
        """Layer i of a decode step, compiled where it can be (a dense layer, a compiler)."""
        args = (layer, self.shape, self.kv.k_LHRD[i], self.kv.v_LHRD[i], x_B1M, cos, sin, groups)
        if self._compiled_layer is None or layer.moe is not None:
            return decode_layer(*args, self.attention)
        for t in (x_B1M, cos, sin, *(t for group in groups for t in group if t is not None)):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for table, _, siblings in groups:
            torch._dynamo.maybe_mark_dynamic(table, 1)
            if siblings is not None:
                torch._dynamo.maybe_mark_dynamic(siblings, 1)
        try:
            return self._compiled_layer(*args, decode_attention)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            log.warning("compiling the decode layer failed (%s); running it eagerly", type(exc).__name__)
            self._compiled_layer = None
            return decode_layer(*args, self.attention)

    def _store_all(self, rows_B: torch.Tensor, k_LBHD: torch.Tensor, v_LBHD: torch.Tensor) -> None:
        """Every layer's new keys and values into the pool at rows `rows_B`: one copy each over the
        pool seen as rows of D (an index along its third dimension was far slower)."""
        _, Hkv, R, D = self.kv.k_LHRD.shape
        L, B = k_LBHD.shape[0], rows_B.shape[0]
        at_LBH = (torch.arange(L, device=rows_B.device).view(L, 1, 1) * (Hkv * R)
                  + torch.arange(Hkv, device=rows_B.device).view(1, 1, Hkv) * R + rows_B.view(1, B, 1))
        self.kv.k_LHRD.view(-1, D).index_copy_(0, at_LBH.view(-1), k_LBHD.reshape(-1, D))
        self.kv.v_LHRD.view(-1, D).index_copy_(0, at_LBH.view(-1), v_LBHD.reshape(-1, D))
