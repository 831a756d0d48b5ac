"""The policy head: a causal LM whose forward returns token logprobs, never full logits.

Legend: B = sequences, T = tokens, C = tokens in one logprob chunk, V = vocabulary, H = hidden.

`PolicyHead` wraps a Hugging Face causal LM so that one forward returns the
per-token logprobs (and entropy) of the given ids, computed over chunks of C
tokens (`atelier.kernels.logprobs`, its own checkpoint): the fp32 [B, T, V]
log-softmax is never in memory, only [C, V] blocks, in the forward and in the
backward (docs/pitfalls.md: a whole-vocabulary fp32 log-softmax ran trainers out
of memory). Logprobs are those of log_softmax(logits / temperature), the same
quantity the engine reports (see atelier.inference.sampling).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from atelier.kernels.logprobs import chunked_logprobs

if TYPE_CHECKING:
    from atelier.train.prefix import SharedPrefix

LOGPROB_CHUNK = 512


def chunked_token_logprobs(hidden_BTH: torch.Tensor, lm_head: nn.Linear, ids_BT: torch.Tensor,
                           temperature: float, want_entropy: bool = False,
                           chunk: int = LOGPROB_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[t] | ids[<t]) from the final hidden states, C tokens of the batch at a time.

    Position 0 gets 0 (nothing predicts it). The B sequences are flattened into
    one list of tokens and cut into chunks of C (`atelier.kernels.logprobs`,
    which recomputes each chunk's logits in the backward), so memory holds a
    few [C, V] fp32 blocks whatever B is.
    """
    B, T, H = hidden_BTH.shape
    logp_N, ent_N = chunked_logprobs(hidden_BTH[:, :-1].reshape(-1, H), lm_head.weight, lm_head.bias,
                                     ids_BT[:, 1:].reshape(-1), temperature, chunk, want_entropy)
    zero_B1 = torch.zeros(B, 1, dtype=torch.float32, device=ids_BT.device)
    logp_BT = torch.cat([zero_B1, logp_N.view(B, T - 1)], dim=1)
    entropy_BT = torch.cat([zero_B1, ent_N.view(B, T - 1)], dim=1) if want_entropy else None
    return logp_BT, entropy_BT


class PolicyHead(nn.Module):
    """A causal LM whose forward returns token logprobs (and entropy), never full logits.

    It is the FSDP root: its forward runs inside FSDP's hooks, so the
    embeddings and lm_head are unsharded while the chunked projection runs.
    """

    def __init__(self, lm: nn.Module, chunk: int = LOGPROB_CHUNK) -> None:
        super().__init__()
        self.lm = lm
        self.chunk = chunk

    def forward(self, ids_BT: torch.Tensor, attn_BT: torch.Tensor, temperature: float = 1.0,
                want_entropy: bool = False, prefix: SharedPrefix | None = None):
        """Logprobs of `ids_BT`; with `prefix`, of sequences that continue it (ids_BT holds only what
        follows the prefix, and position 0 of each continuation gets 0, as a sequence's first token)."""
        base = decoder_of(self.lm)
        if prefix is None:
            hidden_BTH = base(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).last_hidden_state
        else:
            B = ids_BT.shape[0]
            attn_BT = torch.cat([attn_BT.new_ones(B, prefix.length), attn_BT], dim=1)
            # use_cache=False: the prefix's cache is read, not grown, and nothing is returned to reuse
            # (with True, transformers warns on every checkpointed forward, then sets it False)
            hidden_BTH = base(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False,
                              **{cache_keyword(type(base)): prefix.cache(B)}).last_hidden_state
        return chunked_token_logprobs(hidden_BTH, self.lm.get_output_embeddings(), ids_BT, temperature,
                                      want_entropy, self.chunk)


def token_logprobs(model: nn.Module, ids_BT: torch.Tensor, attn_BT: torch.Tensor, temperature: float,
                   want_entropy: bool = False, chunk: int = LOGPROB_CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token_t | tokens_<t) for t >= 1 (position 0 gets 0), and per-token entropy.

    `model` is a Hugging Face causal LM or a `PolicyHead` around one (the trainer's).
    """
    head = model if isinstance(model, PolicyHead) else PolicyHead(model, chunk)
    return head(ids_BT, attn_BT, temperature, want_entropy)


@functools.cache
def cache_keyword(decoder_type: type) -> str:
    """transformers 5.20 renamed `past_key_values` to `cache` (the vLLM environment pins an earlier
    one). Cached per decoder class: read once, not at every micro-batch."""
    return "cache" if "cache" in inspect.signature(decoder_type.forward).parameters else "past_key_values"


def decoder_of(lm: nn.Module) -> nn.Module:
    """The causal LM's body (embeddings, layers, final norm), without its output head."""
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a `PolicyHead` (for save_pretrained, config, generation)."""
    return module.lm if isinstance(module, PolicyHead) else module
