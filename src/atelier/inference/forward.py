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
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run each prompt from position 0 into its slot; return last-position logits [B, V] (fp32).

        Prompts are right-padded to one length; padded keys are masked out and
        the cache entries they write lie past the sequence's length, where the
        decode mask ignores them until a real token overwrites them.
        """
        B, P = len(prompts), max(len(p) for p in prompts)
        self.cache.ensure(P + 1)
        ids_BP = torch.zeros((B, P), dtype=torch.long, device=self.device)
        lens_B = torch.tensor([len(p) for p in prompts], device=self.device)
        for b, p in enumerate(prompts):
            ids_BP[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos_BP = torch.arange(P, device=self.device).expand(B, P)
        key_ok_BP = pos_BP < lens_B[:, None]
        causal_PP = torch.ones((P, P), dtype=torch.bool, device=self.device).tril()
        mask_B1PP = (causal_PP[None] & key_ok_BP[:, None, :]).unsqueeze(1)
        slot_idx = torch.tensor(slots, device=self.device)

        x_BPM = self.core.embed_tokens(ids_BP)
        cos, sin = self.core.rotary_emb(x_BPM, pos_BP)
        for i, layer in enumerate(self.layers):
            def attend(h_BPM, i=i, layer=layer):
                q, k, v = self._qkv(layer, h_BPM, pos_BP)
                q, k = _rotate(q, k, cos, sin)
                self.cache.k_LSHTD[i, slot_idx, :, :P] = k
                self.cache.v_LSHTD[i, slot_idx, :, :P] = v
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1PP, scale=self.scaling,
                                                   enable_gqa=True)
                return o.transpose(1, 2).reshape(B, P, -1)
            x_BPM = self._block(layer, x_BPM, attend)
        last_BM = x_BPM[torch.arange(B, device=self.device), lens_B - 1]
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
