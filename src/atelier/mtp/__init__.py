"""Multi-token prediction (MTP) heads, trained by self-distillation, for speculative decoding.

D sequential heads in DeepSeek-V3's shape ride on a causal LM: head k at
position i takes h^{k-1}_i (h^0: the trunk's last hidden state before its
final norm) and the embedding of token t_{i+k}, projects their concatenation
back to the hidden size, runs one decoder layer of the base model's own class,
and its output, through the base model's final norm and lm_head (shared, never
copied), is a distribution over t_{i+k+1}. Head k's logits at i are therefore
compared with the main head's at i+k.

Modules:
- config: `MTPConfig` (the `[mtp]` section of a pretrain recipe).
- heads: `MTPHead`, `MTPHeads` (built from a base model, hidden states and
  logits of every head from the trunk's hidden states).
- loss: the self-distillation loss, KL(main at i+k || head k at i), chunked
  over positions and the vocabulary, the teacher detached.
- acceptance: greedy acceptance per head and the mean accepted length.
- store: `mtp.safetensors` + `mtp.json` in a Hugging Face model directory
  (`save_mtp_heads`, `load_mtp_heads`: None where a model has no heads).
- policy: `MTPPolicyHead`, the trainers' policy head with heads attached: one
  forward gives the main logprobs and the heads' distillation loss.

The loops that train them are the pretrain phases (`atelier pretrain` with an
`[mtp]` section; `atelier mtp attach` on a frozen trunk); `atelier mtp eval`
measures acceptance.
"""
