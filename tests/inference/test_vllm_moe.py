"""The tiny Mixtral on vLLM's CPU build: served like the built-in engine, before and after a weight
update (the trainer's fused expert names split into the checkpoint's; the CPU experts repacked).

Oracle: the built-in engine (fp32) on the same weights, greedy tokens equal and logprobs close.
Slow: a vLLM server on a tiny MoE takes minutes to start on a loaded CPU. What vLLM 0.32's CPU
build cannot do for MoE (return the routed experts) is stated in atelier.inference.vllm_engine.
"""

from __future__ import annotations

import pytest

from atelier.inference.types import SamplingParams


def _greedy_pairs(ref, vllm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(0,))
    return [(ref.generate(p, params), vllm.generate(p, params)) for p in prompts]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_vllm_serves_the_tiny_mixtral_like_the_builtin_engine_before_and_after_an_update(tmp_path):
    from transformers import AutoModelForCausalLM

    from atelier.inference.engine import LocalEngine
    from atelier.inference.tiny import VLLM_SHAPE, build_tiny_model
    from atelier.inference.vllm_engine import VLLMEngine
    from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, find_vllm_python

    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        pytest.skip(f"the vLLM environment is absent ({exc.message}); `make vllm-env` builds it")
    path = build_tiny_model(tmp_path / "moe", moe=True, initializer_range=0.2, **VLLM_SHAPE)
    other = build_tiny_model(tmp_path / "moe-2", moe=True, seed=1, initializer_range=0.2, **VLLM_SHAPE)
    prompts = [list(range(40, 60)), list(range(100, 131)), [7, 300, 12, 44, 9]]
    config = VLLMConfig(dtype="float32", chunk_tokens=8, enforce_eager=True, kv_cache_gb=1, max_model_len=512)
    with LocalEngine(path, dtype="float32") as ref, VLLMEngine(path, config, work_dir=tmp_path / "work") as vllm:
        for want, got in _greedy_pairs(ref, vllm, prompts):
            assert got.token_ids == want.token_ids and set(got.versions) == {0}
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-3
            assert want.routes is not None and got.routes is None   # vLLM's CPU build returns none
        new = AutoModelForCausalLM.from_pretrained(other).state_dict()   # what the trainer sends
        ref.update_weights(new, 1)
        vllm.update_weights(new, 1)     # experts (repacked on the CPU), routers and attention
        for want, got in _greedy_pairs(ref, vllm, prompts):
            assert got.token_ids == want.token_ids and set(got.versions) == {1}
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-3


def test_fused_expert_names_split_into_the_checkpoints(tmp_path):
    """The trainer's state_dict (transformers' fused experts) under the names and values that
    transformers itself writes to the checkpoint vLLM loads."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import tiny_moe_config
    from atelier.inference.vllm_engine import checkpoint_names

    model = AutoModelForCausalLM.from_config(tiny_moe_config(512))
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    state = model.state_dict()
    state.pop("lm_head.weight")                            # tied: vLLM re-derives it
    split = checkpoint_names(state, set(on_disk))
    assert set(split) == set(on_disk)
    assert all(torch.equal(split[k], on_disk[k]) for k in on_disk)
    assert checkpoint_names(on_disk, set(on_disk)).keys() == on_disk.keys()
