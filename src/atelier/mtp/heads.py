"""The heads: `MTPHead` (one depth) and `MTPHeads` (D of them, run in sequence).

Legend: B = sequences, T = tokens, H = hidden, V = vocabulary, D = heads.

Head k (1..D) at position i:

    x_i   = proj(cat([norm_h(h^{k-1}_i), norm_e(embed(t_{i+k}))], -1))
    h^k_i = block(x_i)                    # one decoder layer of the base model's class
    logits^k_i = lm_head(final_norm(h^k_i))   # a distribution over t_{i+k+1}

h^0 is the trunk's last hidden state before its final norm. `embed`,
`final_norm` and `lm_head` are the base model's own modules, passed in at
every call and never owned here (so a head adds no copy of the vocabulary
matrices and its state dict holds only its own weights). Over a sequence of T
tokens head k has T - k positions (i = 0..T-k-1: t_{i+k} must exist); its
logits at i are compared with the main head's at i + k. The block attends
causally over its own depth's positions, at the rotary positions of the
hidden states it extends (position i), with the base model's rotary table.
Its attention's `layer_idx` is L + k - 1 (L: the trunk's layers), so one
layer-indexed cache can hold the trunk's and the heads' keys side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from atelier.errors import AtelierError

LOGITS_CHUNK = 1024
SDPA_LIKE = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations that are causal by themselves when given no mask."""


class MTPError(AtelierError):
    """Heads that cannot be built for, loaded into or trained with a model."""


@dataclass(frozen=True)
class BaseParts:
    """What the heads share with the base causal LM."""

    decoder: nn.Module
    embed: nn.Embedding
    norm: nn.Module
    lm_head: nn.Linear
    rotary: nn.Module


def base_parts(base: nn.Module) -> BaseParts:
    """The embedding, final norm, lm_head and rotary table of a Hugging Face causal LM."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    parts = [getattr(decoder, name, None) for name in ("norm", "rotary_emb", "layers")]
    if decoder is None or any(p is None for p in parts):
        raise MTPError(f"{type(base).__name__} has no decoder with `norm`, `rotary_emb` and `layers`",
                       hint="MTP heads need a Llama-like causal LM (Llama, Qwen, Mistral, Mixtral and alike)")
    return BaseParts(decoder, base.get_input_embeddings(), decoder.norm, base.get_output_embeddings(),
                     decoder.rotary_emb)


class MTPHead(nn.Module):
    """One depth: two RMSNorms, a projection of their concatenation, one decoder layer."""

    def __init__(self, config, norm_cls: type[nn.Module], layer_cls: type[nn.Module], depth: int) -> None:
        super().__init__()
        hidden, eps, layers = config.hidden_size, config.rms_norm_eps, config.num_hidden_layers
        self.depth = depth
        self.norm_h = norm_cls(hidden, eps=eps)
        self.norm_e = norm_cls(hidden, eps=eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        # built as the last trunk layer (per-layer attributes such as a sliding window follow it), then
        # renumbered past the trunk for caches indexed by layer
        self.block = layer_cls(config, layers - 1)
        attention = getattr(self.block, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = layers + depth - 1

    def forward(self, h_prev_BTH: torch.Tensor, next_ids_BT: torch.Tensor, base: nn.Module,
                position_ids_BT: torch.Tensor | None = None, **block_kwargs) -> torch.Tensor:
        """h^k from h^{k-1} and the ids of t_{i+k}, both [B, T]-aligned; the output is pre-norm.

        `block_kwargs` go to the decoder layer (a cache, say); without a cache the positions are
        0..T-1 and attention is causal over them.
        """
        parts = base_parts(base)
        e_BTH = parts.embed(next_ids_BT)
        x_BTH = self.proj(torch.cat([self.norm_h(h_prev_BTH), self.norm_e(e_BTH.to(h_prev_BTH.dtype))], -1))
        T = x_BTH.shape[1]
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=x_BTH.device)[None]
        cos_sin = parts.rotary(x_BTH, position_ids_BT)
        mask = block_kwargs.pop("attention_mask", None)
        if mask is None and T > 1 and _attn_impl(base) not in SDPA_LIKE:
            mask = _causal_mask(T, x_BTH.dtype, x_BTH.device)
        out = self.block(x_BTH, attention_mask=mask, position_ids=position_ids_BT,
                         position_embeddings=cos_sin, **block_kwargs)
        return out[0] if isinstance(out, tuple) else out   # transformers 4.x layers return a tuple


def _attn_impl(base: nn.Module) -> str:
    return str(getattr(base.config, "_attn_implementation", None) or "eager")


def _causal_mask(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive [1, 1, T, T] causal mask an eager attention adds to its scores."""
    blocked = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


class MTPHeads(nn.Module):
    """D sequential heads for one base model; `tokens_seen` counts the tokens they trained on."""

    def __init__(self, base: nn.Module, heads: int, init: str = "scratch") -> None:
        super().__init__()
        if heads < 1:
            raise MTPError(f"MTPHeads needs at least one head, got {heads}", hint="set mtp.heads >= 1")
        parts = base_parts(base)
        config = base.config
        layer_cls, norm_cls = type(parts.decoder.layers[-1]), type(parts.norm)
        try:
            self.heads = nn.ModuleList(MTPHead(config, norm_cls, layer_cls, k + 1) for k in range(heads))
        except (TypeError, AttributeError) as exc:
            raise MTPError(f"cannot build an MTP head from {layer_cls.__name__} and {norm_cls.__name__} "
                           f"({type(exc).__name__}: {exc})",
                           hint="MTP heads need a Llama-like decoder layer `Layer(config, layer_idx)` and "
                                "an RMSNorm `Norm(hidden_size, eps=...)`") from None
        if init not in ("scratch", "last_layer"):
            raise MTPError(f"unknown MTP init {init!r}", hint="use scratch or last_layer")
        self.apply(base._init_weights)   # the base model's own initialisation, on the heads' modules only
        if init == "last_layer":
            for head in self.heads:
                head.block.load_state_dict(parts.decoder.layers[-1].state_dict())
        self.model_type = str(getattr(config, "model_type", ""))
        self.architectures = list(getattr(config, "architectures", None) or [type(base).__name__])
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.tokens_seen = 0
        self.draft_vocab: int | None = None   # the first ids they were distilled on (None: all)
        self.info: dict = {}   # how they were trained (mtp.json's `training`)
        param = next(parts.decoder.parameters())
        self.to(device=param.device, dtype=param.dtype)

    def __len__(self) -> int:
        return len(self.heads)

    def hidden_states(self, h0_BTH: torch.Tensor, ids_BT: torch.Tensor, base: nn.Module) -> list[torch.Tensor]:
        """[h^1, ..., h^D], h^k of shape [B, T-k, H] (pre-norm): head k at i from h^{k-1}_i and t_{i+k}."""
        T = ids_BT.shape[1]
        if h0_BTH.shape[:2] != ids_BT.shape:
            raise MTPError(f"hidden states {tuple(h0_BTH.shape)} do not match ids {tuple(ids_BT.shape)}",
                           hint="pass the trunk's [B, T, H] states before its final norm for the same ids")
        out, h = [], h0_BTH
        for k, head in enumerate(self.heads, 1):
            if T - k < 1:
                break
            h = head(h[:, :T - k], ids_BT[:, k:], base)
            out.append(h)
        return out

    def logits(self, h0_BTH: torch.Tensor, ids_BT: torch.Tensor, base: nn.Module,
               chunk: int = LOGITS_CHUNK) -> list[torch.Tensor]:
        """Each head's logits [B, T-k, V] through the shared final norm and lm_head: head k's at i
        predict t_{i+k+1} and are compared with the main head's at i+k. The vocabulary projection
        runs `chunk` positions at a time, so the only [*, V] tensors held are the outputs."""
        parts = base_parts(base)
        out = []
        for h_BTH in self.hidden_states(h0_BTH, ids_BT, base):
            normed = parts.norm(h_BTH)
            B, Tk, H = normed.shape
            flat = normed.reshape(-1, H)
            blocks = [F.linear(flat[s:s + chunk], parts.lm_head.weight, parts.lm_head.bias)
                      for s in range(0, flat.shape[0], chunk)]
            out.append(torch.cat(blocks).view(B, Tk, -1))
        return out
