"""The trainers' policy head with MTP heads attached: one forward, the main logprobs and the heads' loss.

Legend: B = sequences, T = tokens, H = hidden, K = heads.

`MTPPolicyHead` is a `PolicyHead` (same forward, same FSDP root, same checkpoints of the
wrapped model) that also owns `mtp` (an `MTPHeads`). Called with `mtp_mask` it runs the trunk
once, takes h^0 (the input of the final norm, caught by a hook on it), runs the heads, and
returns the main logprobs and an `MTPStepOutput`: the summed distillation loss (weighted by
`mtp_mask` at each teacher position's target, `atelier.mtp.loss.head_weights`), per-head KL
sums and the greedy acceptance counts of the batch.

trunk = "frozen": the trunk runs under no_grad (its parameters are the caller's to freeze); the
main logprobs come out of the distillation's own teacher pass, with no gradient. trunk = "joint":
the trunk's graph is kept, the main logprobs are the usual chunked ones (the caller's NLL
trains the trunk), and the heads' loss reaches the trunk through h^0 and the shared final norm,
embedding and lm_head, never through the teacher's side.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from atelier.mtp.acceptance import Acceptance
from atelier.mtp.heads import MTPError, MTPHeads
from atelier.mtp.loss import align_to_teacher, distill_kl, head_weights
from atelier.train.head import LOGPROB_CHUNK, PolicyHead, chunked_token_logprobs, decoder_of

TRUNK_MODES = ("frozen", "joint")


@dataclass
class MTPStepOutput:
    """The heads' part of one forward."""

    loss: torch.Tensor           # sum over heads and weighted positions of weight * KL (differentiable)
    kl_sums: list[float]         # per head: sum of weight * KL
    weight_sums: list[float]     # per head: sum of the weights
    acceptance: Acceptance


class MTPPolicyHead(PolicyHead):
    def __init__(self, lm: torch.nn.Module, mtp: MTPHeads, trunk: str = "joint", chunk: int = LOGPROB_CHUNK,
                 kl_chunk: int = 256, vocab: int | None = None) -> None:
        super().__init__(lm, chunk)
        if trunk not in TRUNK_MODES:
            raise ValueError(f"trunk must be one of {TRUNK_MODES}, got {trunk!r}")
        if vocab is not None and not 1 <= vocab <= mtp.vocab_size:
            raise MTPError(f"draft vocabulary {vocab} is outside the model's {mtp.vocab_size} token ids",
                           hint=f"set mtp.draft_vocab to at most {mtp.vocab_size}, or leave it unset")
        self.mtp, self.trunk, self.kl_chunk, self.vocab = mtp, trunk, kl_chunk, vocab

    def forward(self, ids_BT: torch.Tensor, attn_BT: torch.Tensor, temperature: float = 1.0,
                want_entropy: bool = False, prefix=None, mtp_mask: torch.Tensor | None = None):
        if mtp_mask is None:
            return super().forward(ids_BT, attn_BT, temperature, want_entropy, prefix)
        return self._with_heads(ids_BT, attn_BT, mtp_mask)

    def _with_heads(self, ids_BT: torch.Tensor, attn_BT: torch.Tensor, mask_BT: torch.Tensor
                    ) -> tuple[torch.Tensor, MTPStepOutput]:
        frozen = self.trunk == "frozen"
        decoder = decoder_of(self.lm)
        h0_BTH, normed_BTH = _trunk(decoder, ids_BT, attn_BT, frozen)
        lm_head = self.lm.get_output_embeddings()
        B, T, H = normed_BTH.shape
        states = self.mtp.hidden_states(h0_BTH, ids_BT, self.lm)
        K = len(states)
        student_KBTH = torch.stack([align_to_teacher(decoder.norm(h), k) for k, h in enumerate(states, 1)])
        weights_KBT = head_weights(mask_BT, K)
        targets_BT = torch.zeros_like(ids_BT)
        targets_BT[:, :-1] = ids_BT[:, 1:]
        out = distill_kl(normed_BTH.reshape(-1, H), student_KBTH.reshape(K, -1, H), lm_head.weight,
                         lm_head.bias, weights_KBT.reshape(K, -1), targets_BT.reshape(-1), self.kl_chunk,
                         self.vocab)
        if frozen:   # the teacher's pass gave the main logprobs (position 0 gets 0, as chunked_token_logprobs)
            logp_BT = torch.cat([torch.zeros(B, 1, device=ids_BT.device),
                                 out.teacher_logp_N.view(B, T)[:, :-1]], dim=1)
        else:
            logp_BT, _ = chunked_token_logprobs(normed_BTH, lm_head, ids_BT, 1.0, False, self.chunk)
        acceptance = Acceptance(K)
        acceptance.add(out.match_KN.view(K, B, T), weights_KBT)
        kl_KN, w_KN = out.kl_KN, weights_KBT.reshape(K, -1)
        return logp_BT, MTPStepOutput(out.loss, (kl_KN * w_KN).sum(1).tolist(), w_KN.sum(1).tolist(), acceptance)


def _trunk(decoder: torch.nn.Module, ids_BT: torch.Tensor, attn_BT: torch.Tensor, frozen: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's last hidden state before its final norm (h^0) and after it."""
    caught: list[torch.Tensor] = []
    hook = decoder.norm.register_forward_pre_hook(lambda _module, args: caught.append(args[0]))
    try:
        with torch.no_grad() if frozen else contextlib.nullcontext():
            normed_BTH = decoder(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).last_hidden_state
    finally:
        hook.remove()
    return caught[-1], normed_BTH
