"""The heads on a real (tiny) model: shapes and alignment, causality, training in both trunk modes."""

from __future__ import annotations

import pytest
import torch

from atelier.mtp.heads import MTPError, MTPHeads, base_parts
from atelier.mtp.policy import MTPPolicyHead
from tests.mtp.conftest import copying_model_and_heads, tiny_lm


def _ids(seed: int = 1, B: int = 2, T: int = 24, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    return mask


def test_heads_are_built_from_the_base_models_own_classes() -> None:
    model = tiny_lm()
    mtp = MTPHeads(model, 3)
    head = mtp.heads[0]
    assert type(head.block) is type(model.model.layers[-1])
    assert type(head.norm_h) is type(model.model.norm) and head.norm_h.variance_epsilon == model.config.rms_norm_eps
    assert head.proj.weight.shape == (32, 64) and head.proj.bias is None
    assert [h.block.self_attn.layer_idx for h in mtp.heads] == [2, 3, 4]
    names = set(mtp.state_dict())
    assert "heads.0.block.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)   # shared with the base, never copied
    assert "heads.2.block.mlp.down_proj.weight" in names and "heads.3.proj.weight" not in names


def test_last_layer_init_copies_the_trunks_last_layer() -> None:
    model = tiny_lm()
    mtp = MTPHeads(model, 2, init="last_layer")
    last = model.model.layers[-1].state_dict()
    for head in mtp.heads:
        assert all(torch.equal(v, last[k]) for k, v in head.block.state_dict().items())
    with pytest.raises(MTPError):
        MTPHeads(model, 2, init="copy")


def test_a_head_that_copies_the_teacher_has_zero_loss_and_full_acceptance() -> None:
    model, mtp = copying_model_and_heads(3, copy="embedding")
    ids = _ids()
    _, out = MTPPolicyHead(model, mtp, "frozen")(ids, torch.ones_like(ids), mtp_mask=_mask(ids))
    assert max(out.kl_sums) < 1e-4 * min(out.weight_sums)
    stats = out.acceptance.to_dict()
    assert [h["rate"] for h in stats["per_head"]] == [1.0, 1.0, 1.0]
    assert stats["mean_accepted_length"] == pytest.approx(4.0)
    # the same heads one position too early (copying h^{k-1}_i, the teacher at i + k - 1) are penalised
    model, early = copying_model_and_heads(3, copy="hidden")
    _, off = MTPPolicyHead(model, early, "frozen")(ids, torch.ones_like(ids), mtp_mask=_mask(ids))
    assert min(k / w for k, w in zip(off.kl_sums, off.weight_sums)) > 0.1


def test_logits_are_aligned_and_match_the_hidden_states() -> None:
    model = tiny_lm()
    mtp = MTPHeads(model, 2)
    ids = _ids(T=10)
    h0 = model.model(input_ids=ids, output_hidden_states=False).last_hidden_state
    with torch.no_grad():
        parts = base_parts(model)
        pre = []
        hook = parts.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
        model.model(input_ids=ids)
        hook.remove()
        states = mtp.hidden_states(pre[-1], ids, model)
        logits = mtp.logits(pre[-1], ids, model, chunk=3)
    assert [s.shape for s in states] == [(2, 9, 32), (2, 8, 32)]
    assert [x.shape for x in logits] == [(2, 9, 97), (2, 8, 97)]
    assert torch.allclose(logits[1], model.lm_head(parts.norm(states[1])), atol=1e-5)
    assert torch.allclose(parts.norm(pre[-1]), h0, atol=1e-6)   # h^0 is the final norm's input
    with pytest.raises(MTPError):
        mtp.hidden_states(pre[-1][:, :5], ids, model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_heads_attend_causally(attn) -> None:
    model = tiny_lm(attn=attn)
    mtp = MTPHeads(model, 2)
    ids = _ids(T=12)
    later = ids.clone()
    later[:, 8:] = (later[:, 8:] + 5) % 97
    with torch.no_grad():
        h = model.model.embed_tokens(ids)   # any h^0 of the right shape; the same at every early position
        a, b = mtp.hidden_states(h, ids, model), mtp.hidden_states(h, later, model)
    # head k at i reads t_{i+k}: positions with i + k < 8 cannot see the change
    assert torch.allclose(a[0][:, :7], b[0][:, :7], atol=1e-6) and not torch.allclose(a[0][:, 7], b[0][:, 7])
    assert torch.allclose(a[1][:, :6], b[1][:, :6], atol=1e-6)


def test_eager_and_sdpa_heads_agree() -> None:
    ids = _ids(T=12)
    outs = []
    for attn in ("sdpa", "eager"):
        model = tiny_lm(attn=attn)
        torch.manual_seed(3)
        mtp = MTPHeads(model, 2)
        with torch.no_grad():
            outs.append(mtp.hidden_states(model.model.embed_tokens(ids), ids, model))
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(*outs))


def _train(trunk: str, steps: int = 25) -> tuple[list[float], torch.nn.Module, dict]:
    model = tiny_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if trunk == "frozen":
        model.requires_grad_(False)
    torch.manual_seed(0)
    policy = MTPPolicyHead(model, MTPHeads(model, 2), trunk)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(T=32, B=4)
    losses = []
    for _ in range(steps):
        logp, out = policy(ids, torch.ones_like(ids), mtp_mask=_mask(ids))
        loss = out.loss / sum(out.weight_sums)
        if trunk == "joint":
            loss = loss - (logp * _mask(ids)).sum() / _mask(ids).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(out.kl_sums) / sum(out.weight_sums))
    return losses, model, before


def test_frozen_trunk_heads_train_and_the_trunk_stays() -> None:
    losses, model, before = _train("frozen")
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_joint_trunk_trains_on_both_losses() -> None:
    losses, model, before = _train("joint")
    assert losses[-1] < losses[0], losses
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before["model.layers.0.mlp.up_proj.weight"])


def test_joint_gradients_never_pass_through_the_teacher() -> None:
    """The heads' loss reaches the trunk as a direct computation with the teacher detached does."""
    model = tiny_lm()
    policy = MTPPolicyHead(model, MTPHeads(model, 2), "joint", kl_chunk=5)
    ids = _ids(T=16)
    _, out = policy(ids, torch.ones_like(ids), mtp_mask=_mask(ids))
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    caught = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: caught.append(a[0]))
    normed = model.model(input_ids=ids).last_hidden_state
    hook.remove()
    states = policy.mtp.hidden_states(caught[-1], ids, model)
    W = model.lm_head.weight
    expected = 0
    for k, h in enumerate(states, 1):   # teacher at j = i + k for i = 0..T-k-2 (token j + 1 must exist)
        logp = torch.log_softmax(normed[:, k:-1].detach() @ W.detach().T, -1)
        logq = torch.log_softmax(model.model.norm(h[:, :-1]) @ W.T, -1)
        expected = expected + (logp.exp() * (logp - logq)).sum()
    want = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
    for got, ref in zip(grads, want):
        assert (got is None) == (ref is None)
        if got is not None:
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-3)


def test_a_model_without_the_pieces_is_refused() -> None:
    with pytest.raises(MTPError, match="decoder"):
        MTPHeads(torch.nn.Linear(2, 2), 1)
    with pytest.raises(MTPError, match="at least one"):
        MTPHeads(tiny_lm(), 0)
