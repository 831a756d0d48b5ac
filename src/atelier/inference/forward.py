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

Shape legend: B batch (sequences), P prompt length (padded), T cache length,
L layers, H query heads, Hkv key/value heads, D head dim, M model width,
V vocabulary.

Supported: `model_type` in `SUPPORTED_TYPES` (Llama, Mistral without a
sliding window, Qwen2). Others raise `UnsupportedModel` when loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atelier.errors import AtelierError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModel(AtelierError):
    """The local engine has no batched forward for this architecture."""


def _rotate(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor):
    cos = cos_BTD.unsqueeze(1)
    sin = sin_BTD.unsqueeze(1)

    def half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q_BHTD * cos + half(q_BHTD) * sin, k_BHTD * cos + half(k_BHTD) * sin


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
                config.model_type == "mistral":
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
        param = next(hf_model.parameters())
        self.cache = SlotCache(len(self.layers), max_slots, self.kv_heads, self.head_dim,
                               param.dtype, param.device)

    @property
    def device(self) -> torch.device:
        return self.cache.k_LSHTD.device

    def _qkv(self, layer, x_BTM: torch.Tensor, pos_BT: torch.Tensor):
        attn = layer.self_attn
        B, T, _ = x_BTM.shape
        q = attn.q_proj(x_BTM).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x_BTM).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x_BTM).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def _block(self, layer, x_BTM, attend) -> torch.Tensor:
        h = layer.input_layernorm(x_BTM)
        a_BTM = attend(h)
        x_BTM = x_BTM + layer.self_attn.o_proj(a_BTM)
        return x_BTM + layer.mlp(layer.post_attention_layernorm(x_BTM))

    def _logits(self, h_BM: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.core.norm(h_BM)).float()

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
        cached = any(starts)
        if cached:  # attend over the slot: the cached prefix, then this chunk, causally
            mask_B1NT = (torch.arange(T, device=self.device)[None, None, :] <= pos_BN[:, :, None]).unsqueeze(1)
        else:       # attend over this chunk's own keys: no read back from the cache
            causal_NN = torch.ones((N, N), dtype=torch.bool, device=self.device).tril()
            key_ok_BN = torch.arange(N, device=self.device)[None, :] < lens_B[:, None]
            mask_B1NT = (causal_NN[None] & key_ok_BN[:, None, :]).unsqueeze(1)
        slots = slice(first_slot, first_slot + B)
        slot_B1 = torch.arange(first_slot, first_slot + B, device=self.device)[:, None]

        x_BNM = self.core.embed_tokens(ids_BN)
        cos, sin = self.core.rotary_emb(x_BNM, pos_BN)
        for i, layer in enumerate(self.layers):
            def attend(h_BNM, i=i, layer=layer):
                q, k, v = self._qkv(layer, h_BNM, pos_BN)
                q, k = _rotate(q, k, cos, sin)
                if cached:
                    self.cache.k_LSHTD[i, slot_B1, :, pos_BN] = k.transpose(1, 2)
                    self.cache.v_LSHTD[i, slot_B1, :, pos_BN] = v.transpose(1, 2)
                    k, v = self.cache.k_LSHTD[i, slots, :, :T], self.cache.v_LSHTD[i, slots, :, :T]
                else:
                    self.cache.k_LSHTD[i, slots, :, :N] = k
                    self.cache.v_LSHTD[i, slots, :, :N] = v
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1NT, scale=self.scaling,
                                                   enable_gqa=True)
                return o.transpose(1, 2).reshape(B, N, -1)
            x_BNM = self._block(layer, x_BNM, attend)
        last_BM = x_BNM[torch.arange(B, device=self.device), lens_B - 1]
        return self._logits(last_BM)

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
        rows = torch.arange(B, device=self.device)
        mask_B11T = (torch.arange(T, device=self.device)[None, :] <= pos_B1)[:, None, None, :]
        pos_B = pos_B1[:, 0]

        x_B1M = self.core.embed_tokens(ids_B1)
        cos, sin = self.core.rotary_emb(x_B1M, pos_B1)
        for i, layer in enumerate(self.layers):
            def attend(h_B1M, i=i, layer=layer):
                q, k, v = self._qkv(layer, h_B1M, pos_B1)
                q, k = _rotate(q, k, cos, sin)
                self.cache.k_LSHTD[i, rows, :, pos_B] = k[:, :, 0]
                self.cache.v_LSHTD[i, rows, :, pos_B] = v[:, :, 0]
                keys = self.cache.k_LSHTD[i, :B, :, :T]
                values = self.cache.v_LSHTD[i, :B, :, :T]
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B11T,
                                                   scale=self.scaling, enable_gqa=True)
                return o.transpose(1, 2).reshape(B, 1, -1)
            x_B1M = self._block(layer, x_B1M, attend)
        return self._logits(x_B1M[:, 0])
