"""Mixture-of-experts support applied to a Hugging Face model from outside.

Model code stays free of precision and routing tricks (torchtitan's rule):
these functions take a loaded `transformers` MoE model (Qwen3-MoE, OLMoE,
Mixtral: a top-k softmax router module `*TopKRouter` returning
(logits, scores, indices), and a fused experts module with `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I]) and change what its modules do.

- `precision.apply_moe_precision`: expert matmuls through
  `atelier.kernels.grouped_linear` in a low-precision recipe.
- `replay.RouterReplay`: record the top-k experts the sampler chose, and
  make a later forward use exactly those while the gate values are
  recomputed (so the router still gets gradients).
- `metrics`: sampler-versus-trainer mismatch and router load balance.
"""
