"""Weight sync: the delta chain rebuilds the trainer's weights bit for bit."""

from __future__ import annotations

import torch

from atelier.rl.weight_sync import DeltaChainWeightSync, InProcessWeightSync


def _train_like_steps(n: int, seed: int = 0):
    """Weights as a trainer changes them: most tensors move a little, some not at all."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "w_fp32": torch.randn(64, 32, generator=g),
        "w_bf16": torch.randn(128, generator=g).to(torch.bfloat16),
        "frozen": torch.randn(16, generator=g),
        "count": torch.arange(5, dtype=torch.int64),
    }
    out = [{k: v.clone() for k, v in sd.items()}]
    for _ in range(n):
        sd["w_fp32"] += 1e-4 * torch.randn(64, 32, generator=g)
        sd["w_bf16"] = (sd["w_bf16"].float() + 1e-2 * torch.randn(128, generator=g)).to(torch.bfloat16)
        out.append({k: v.clone() for k, v in sd.items()})
    return out


def _bitwise_equal(a, b) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def test_delta_chain_rebuild_is_bit_exact_across_chains(tmp_path):
    states = _train_like_steps(7)
    writer = DeltaChainWeightSync(tmp_path, full_every=3)
    follower = DeltaChainWeightSync(tmp_path, full_every=3)   # reads after every step
    stats = []
    for step, sd in enumerate(states):
        stats.append(writer.publish(sd, step))
        got, got_step = follower.latest()
        assert got_step == step and _bitwise_equal(got, sd)
    # a fresh reader rebuilds the newest weights from the chain alone
    got, got_step = DeltaChainWeightSync(tmp_path, full_every=3).latest()
    assert got_step == 7 and _bitwise_equal(got, states[-1])
    kinds = [s.kind for s in stats]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]
    # the frozen tensors are not written in deltas
    assert all(s.changed_tensors == 2 for s in stats if s.kind == "delta")
    assert all(s.bytes > 0 and s.seconds >= 0 for s in stats)


def test_writer_resumes_a_chain_after_a_restart(tmp_path):
    states = _train_like_steps(5, seed=1)
    writer = DeltaChainWeightSync(tmp_path, full_every=100)
    for step in range(4):
        writer.publish(states[step], step)
    # crash; the resumed run restarts from a checkpoint at step 2 and republishes 3, 4
    again = DeltaChainWeightSync(tmp_path, full_every=100)
    again.truncate_after(2)
    assert again.latest()[1] == 2
    assert again.publish(states[3], 3).kind == "delta"
    again.publish(states[4], 4)
    got, step = DeltaChainWeightSync(tmp_path).latest()
    assert step == 4 and _bitwise_equal(got, states[4])


def test_in_process_sync_hands_out_a_detached_copy():
    sync = InProcessWeightSync()
    assert sync.latest() is None
    w = torch.ones(3)
    sync.publish({"w": w}, 1)
    w += 1
    sd, step = sync.latest()
    assert step == 1 and torch.equal(sd["w"], torch.ones(3))


def test_a_tied_head_is_published_once_and_stays_tied(tiny_model_dir):
    """A tied model's state_dict names its embedding twice (`lm_head.weight` too): the published
    copy, in the model's dtype or converted to bf16, holds it once (SmolLM2-135M's fp32 publish
    was 651 MB with the tie copied twice, 538 MB without), and the engine's tied head still
    receives it. `sync_bytes` counts what is held."""
    from transformers import AutoModelForCausalLM

    from atelier.rl.run import _published

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    whole = sum(t.numel() * t.element_size() for t in state.values())
    head = state["lm_head.weight"].numel() * 4
    for dtype, scale in (("same", 1), ("bfloat16", 2)):
        stats = InProcessWeightSync().publish(_published(state, dtype), 1)
        assert stats.bytes == (whole - head) // scale, dtype
    sync = InProcessWeightSync()
    sync.publish(_published(state, "bfloat16"), 1)
    copy, _ = sync.latest()
    assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"]
    assert copy["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(copy["lm_head.weight"], state["model.embed_tokens.weight"].to(torch.bfloat16))
    assert copy["model.norm.weight"].data_ptr() != state["model.norm.weight"].data_ptr()   # still a copy


def test_bf16_deltas_of_a_small_step_are_a_small_fraction_of_a_snapshot(tmp_path):
    g = torch.Generator().manual_seed(2)
    master = torch.randn(256, 256, generator=g)            # fp32 master weights
    sync = DeltaChainWeightSync(tmp_path, full_every=100)
    full = sync.publish({"w": master.to(torch.bfloat16)}, 0)
    master += 1e-5 * torch.randn(256, 256, generator=g)    # a small optimizer step
    delta = sync.publish({"w": master.to(torch.bfloat16)}, 1)
    assert delta.kind == "delta" and delta.bytes < full.bytes / 5
    got, _ = DeltaChainWeightSync(tmp_path).latest()
    assert torch.equal(got["w"].view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
