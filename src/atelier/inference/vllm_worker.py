"""Code that runs inside a vLLM server's workers: `--worker-extension-cls
atelier.inference.vllm_worker.AtelierWorkerExtension`.

vLLM mixes this class into every worker; its methods are called with
`POST /collective_rpc {"method": "atelier_reload_weights", "kwargs": {...}}`
(the server needs `VLLM_SERVER_DEV_MODE=1`). This module is imported by the
vLLM environment, not ours: it imports only the standard library at the top
and torch/vLLM inside the methods, and nothing else from atelier.

Why a method of our own rather than vLLM's `reload_weights` alone
(docs/pitfalls.md, "Driving vLLM"): a tied `lm_head` shares its weight with
`embed_tokens`, so a reload never loads it, and on CPU its matmul uses a
copy packed at load time. After a reload the embedding is new and the packed
head is old: logprobs are wrong with no error
(docs/log/2026-12-03-figures-from-the-code.md). So after every
reload the head is re-tied to the embedding and re-packed. The CPU build's
mixture-of-experts layers have the same trap (`atelier_repack_moe`).
"""

from __future__ import annotations

from typing import Any


class AtelierWorkerExtension:
    """Methods vLLM adds to its worker class (`self` is the worker)."""

    def atelier_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Load every `*.safetensors` in `weights_path` (HF names, whole fused groups) in place,
        then re-derive a tied `lm_head` from `embed_tokens`."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"retied_lm_head": self.atelier_retie_lm_head(), "repacked_moe": self.atelier_repack_moe()}

    def atelier_repack_moe(self) -> int:
        """Redo the CPU experts' weight packing after a reload; returns how many MoE layers.

        vLLM 0.32's CPU experts pre-pack w13/w2 into their grouped-GEMM layout once, at load
        (`CPUUnquantizedExperts.process_weights_after_loading`, `cpu_prepack_moe_weight`). A
        weight update copies the new, unpacked weights over them and skips that step
        (`UnquantizedFusedMoEMethod._setup_kernel` runs it only when no kernel exists yet), so
        the kernel reads unpacked weights as packed: wrong outputs, no error."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        layers = 0
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
                experts.process_weights_after_loading(module)
                layers += 1
        return layers

    def atelier_retie_lm_head(self) -> bool:
        """Point a tied `lm_head` at `embed_tokens`' weight and redo its post-load processing
        (the CPU weight packing). Returns whether the model ties them."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        if not getattr(config, "tie_word_embeddings", False):
            return False
        head = getattr(model, "lm_head", None)
        embed = _embed_tokens(model)
        if head is None or embed is None:
            raise RuntimeError("the model ties its word embeddings but has no lm_head/embed_tokens to re-tie")
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
        return True

    def atelier_weight_checksum(self, name: str) -> float:
        """Sum of one parameter's values (tests check a reload landed in every worker)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return float(dict(model.named_parameters())[name].double().sum())


def _embed_tokens(model: Any) -> Any:
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return inner.embed_tokens
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            return module
    return None
