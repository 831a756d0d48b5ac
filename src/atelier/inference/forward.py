"""A batched Llama-family forward pass with a slot-based KV cache.

The engine's scheduler needs two operations that Hugging Face's `forward`
with a `DynamicCache` makes awkward: *prefill* a few new sequences into free
cache slots while others are mid-generation, and *decode* one token for every
active sequence at once, each at its own position. This module runs the
model's own submodules (embeddings, RMSNorms, projections, MLPs, rotary
embedding, LM head: so the weights and any `update_weights` live in the HF
model) and does only the attention and the cache itself.

Cache layout: one tensor each for keys and values, `[L, S, Hkv, T, D]`, where
slot `s` holds one sequence. Active sequences always occupy slots `0..B-1`
(the engine compacts on finish with `move_slot`), so a decode step attends
over a *view* `[:B, :, :Tmax]` instead of gathering. `T` grows by doubling.

Cost per decoder layer and step (what makes a step cheap on a CPU, where
every multi-threaded op pays a synchronisation however small it is): q/k/v
and gate/up run as one matmul each over fused weights whose slices *are* the
model's parameters (so `update_weights` needs no extra step), RMSNorm is one
fused op, the new keys and values go into the cache with one `index_copy_`
each (advanced-index assignment was ~100x slower), and attention is one
`scaled_dot_product_attention`.

Shape legend: B batch (sequences), N new tokens per sequence in a prefill
(padded), T key positions (cache length), L layers, S slots, H query heads,
Hkv key/value heads, X = H + 2 Hkv fused q/k/v heads, D head dim, M model
width, V vocabulary.

Supported: `model_type` in `SUPPORTED_TYPES` (Llama, Mistral and Mixtral
without a sliding window, Qwen2). Others raise `UnsupportedModel` when
loaded. A mixture-of-experts layer (Mixtral's) runs the model's own sparse
block on the normed hidden states, so router hooks (atelier.moe.replay) and
low-precision experts (atelier.moe.precision) apply to the engine too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atelier.errors import AtelierError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "mixtral")


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


class SlotCache:
    """Keys and values for up to `slots` sequences; grows along T on demand.

    Every method runs under `torch.inference_mode`: the buffers are inference
    tensors, which may only be written there.
    """

    @torch.inference_mode()
    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device,
                 initial_len: int = 256) -> None:
        shape = (layers, slots, kv_heads, initial_len, head_dim)
        self.k_LSHTD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LSHTD = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k_LSHTD.shape[3]

    @torch.inference_mode()
    def ensure(self, length: int) -> None:
        """Make room for `length` positions per slot (doubling; copies once per growth)."""
        if length <= self.capacity:
            return
        new_len = self.capacity
        while new_len < length:
            new_len *= 2
        for name in ("k_LSHTD", "v_LSHTD"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], new_len, old.shape[4]))
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst`."""
        if src != dst and length > 0:
            self.k_LSHTD[:, dst, :, :length] = self.k_LSHTD[:, src, :, :length]
            self.v_LSHTD[:, dst, :, :length] = self.v_LSHTD[:, src, :, :length]

    @torch.inference_mode()
    def read(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions `start:end` of `slot`: (k, v), each `[L, Hkv, end-start, D]`."""
        return (self.k_LSHTD[:, slot, :, start:end].clone(), self.v_LSHTD[:, slot, :, start:end].clone())

    @torch.inference_mode()
    def write(self, slot: int, start: int, k_LHnD: torch.Tensor, v_LHnD: torch.Tensor) -> None:
        """Put `n` positions of keys and values into `slot` from position `start`."""
        end = start + k_LHnD.shape[2]
        self.ensure(end)
        self.k_LSHTD[:, slot, :, start:end] = k_LHnD
        self.v_LSHTD[:, slot, :, start:end] = v_LHnD


class BatchedForward:
    """Prefill and decode over a Hugging Face Llama-family causal LM."""

    def __init__(self, hf_model, max_slots: int) -> None:
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
        self.cache = SlotCache(len(self.layers), max_slots, self.kv_heads, self.head_dim,
                               param.dtype, param.device)

    @property
    def device(self) -> torch.device:
        return self.cache.k_LSHTD.device

    def _rope(self, x_BTM: torch.Tensor, pos_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_BTD, sin_BTD = self.core.rotary_emb(x_BTM, pos_BT)
        half = self.head_dim // 2
        sin_BTD = torch.cat((-sin_BTD[..., :half], sin_BTD[..., half:]), dim=-1)
        return cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)

    def _slot_rows(self, slot_B: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
        """Row indices into one layer's cache viewed as [S*Hkv*Tcap, D], for (slot, head, position),
        ordered like k.reshape(-1, D) for k of shape [B, Hkv, T, D]."""
        heads = torch.arange(self.kv_heads, device=self.device)
        cap = self.cache.capacity
        return ((slot_B[:, None, None] * self.kv_heads + heads[None, :, None]) * cap
                + pos_BT[:, None, :]).reshape(-1)

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

    def _logits(self, h_BM: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_norm(self.core.norm, h_BM)).float()

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], first_slot: int, starts: list[int] | None = None) -> torch.Tensor:
        """Run prompt b into slot `first_slot + b` from position `starts[b]`; return last-position
        logits [B, V] (fp32).

        Positions before `starts[b]` must already be in the slot (a prefix-cache hit); only
        `prompts[b][starts[b]:]` is computed. Chunks are right-padded to one length N; the cache
        entries padding writes lie past the sequence's length, where no real query looks and
        decoding overwrites them before its mask lets them in.
        """
        B = len(prompts)
        starts = starts or [0] * B
        chunks = [p[s:] for p, s in zip(prompts, starts)]
        N = max(len(c) for c in chunks)
        T = max(starts) + N  # keys a query may see: cached prefix plus this chunk
        self.cache.ensure(T + 1)
        ids_BN = torch.zeros((B, N), dtype=torch.long, device=self.device)
        for b, c in enumerate(chunks):
            ids_BN[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        lens_B = torch.tensor([len(c) for c in chunks], device=self.device)
        start_B = torch.tensor(starts, device=self.device)
        pos_BN = start_B[:, None] + torch.arange(N, device=self.device)
        slots = slice(first_slot, first_slot + B)
        cached = any(starts)
        if cached:  # attend over the slot: the cached prefix, then this chunk, causally
            mask_B1NT = (torch.arange(T, device=self.device)[None, None, :] <= pos_BN[:, :, None]).unsqueeze(1)
            rows = self._slot_rows(torch.arange(first_slot, first_slot + B, device=self.device), pos_BN)
        else:       # attend over this chunk's own keys: no read back from the cache
            causal_NN = torch.ones((N, N), dtype=torch.bool, device=self.device).tril()
            key_ok_BN = torch.arange(N, device=self.device)[None, :] < lens_B[:, None]
            mask_B1NT = (causal_NN[None] & key_ok_BN[:, None, :]).unsqueeze(1)

        def attend(i, q, k, v):
            kc, vc = self.cache.k_LSHTD[i], self.cache.v_LSHTD[i]
            if cached:
                kc.view(-1, self.head_dim).index_copy_(0, rows, k.reshape(-1, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, rows, v.reshape(-1, self.head_dim))
                k, v = kc[slots, :, :T], vc[slots, :, :T]
            else:
                kc[slots, :, :N] = k
                vc[slots, :, :N] = v
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1NT, scale=self.scaling,
                                                  enable_gqa=True)

        x_BNM = self._layers(self.core.embed_tokens(ids_BN), pos_BN, attend)
        return self._logits(x_BNM[torch.arange(B, device=self.device), lens_B - 1])

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One step for the sequences in slots `0..B-1`: token b sits at `positions[b]`.

        Returns next-token logits [B, V] (fp32).
        """
        B = len(tokens)
        T = max(positions) + 1
        self.cache.ensure(T)
        ids_B1 = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        pos_B1 = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        mask_B11T = (torch.arange(T, device=self.device)[None, :] <= pos_B1)[:, None, None, :]
        rows = self._slot_rows(torch.arange(B, device=self.device), pos_B1)

        def attend(i, q, k, v):
            kc, vc = self.cache.k_LSHTD[i], self.cache.v_LSHTD[i]
            kc.view(-1, self.head_dim).index_copy_(0, rows, k.reshape(-1, self.head_dim))
            vc.view(-1, self.head_dim).index_copy_(0, rows, v.reshape(-1, self.head_dim))
            return F.scaled_dot_product_attention(q, kc[:B, :, :T], vc[:B, :, :T], attn_mask=mask_B11T,
                                                  scale=self.scaling, enable_gqa=True)

        x_B1M = self._layers(self.core.embed_tokens(ids_B1), pos_B1, attend)
        return self._logits(x_B1M[:, 0])
