"""FSDP2 on a policy head, and what its bf16 policy does on one rank.

`shard(head, ranks, precision)` applies `fully_shard` to every decoder layer
and then to the head (the root, which owns embeddings, final norm and
lm_head, tied or not), with `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` for bf16: compute in bf16, fp32 master weights, fp32
gradient reduction. FSDP averages gradients over ranks; the trainers multiply
each backward by `grad_scale(ranks)` (the world size) so the reduction is a
*sum*: the losses divide by one global constant, and the sum over ranks of
each rank's gradient is the one-rank gradient (docs/pitfalls.md: per-rank
normalisation changes the objective with the number of ranks). (FSDP's own
divide factor needs NCCL's PreMulSum, which gloo lacks.)

On one rank `compute_weights` does what that policy does, without a process
group: for one optimizer step it swaps bf16 copies of the fp32 master weights
into the modules (cast once per step, not at every use as `torch.autocast`
does, which ran slower than fp32 on one rank:
docs/log/2026-12-03-trainer-ranks-and-precision.md), and adds each backward's
bf16 gradients into the masters' fp32 `.grad`; the masters, the optimizer,
state dicts and checkpoints never see a bf16 tensor.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from atelier.train.head import PolicyHead, decoder_of
from atelier.train.ranks import DistributedError, Ranks


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    layers = getattr(decoder_of(lm), "layers", None)
    if layers is None:
        raise DistributedError(f"cannot find the decoder layers of {type(lm).__name__}",
                               hint="FSDP wraps `model.model.layers` (Llama, Qwen, Mistral and alike)")
    return list(layers)


def shard(head: PolicyHead, ranks: Ranks, precision: str, *, activation_checkpointing: bool = False,
          reshard_after_forward: bool = True) -> PolicyHead:
    """FSDP2 per decoder layer, then the root; mixed precision; optional per-layer checkpointing."""
    if activation_checkpointing:
        lm, kwargs = head.lm, {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5 renamed it, and its keyword
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for layer in decoder_layers(lm):
            # The only caches a policy's forward is given are ReadOnlyKVCaches, which are read, never
            # grown: transformers may keep them under checkpointing (else it drops the shared prefix)
            layer._can_checkpoint_with_cache = True
    if not ranks.sharded:
        return head.to(ranks.device)
    head.to(ranks.device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for layer in decoder_layers(head.lm):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(head, mp_policy=mp)
    return head


def grad_scale(ranks: Ranks) -> float:
    """What each rank's loss is multiplied by before backward so FSDP's mean over ranks is a sum."""
    return float(ranks.world)


def _to_master(master: nn.Parameter):
    def hook(copy: torch.Tensor) -> None:
        grad = copy.grad.to(master.dtype)
        master.grad = grad if master.grad is None else master.grad.add_(grad)
        copy.grad = None
    return hook


@contextlib.contextmanager
def compute_weights(modules: list[nn.Module | None], ranks: Ranks, precision: str) -> Iterator[None]:
    """One optimizer step's forwards and backwards in bf16 on one rank (FSDP's policy does it on many).

    Every floating parameter of `modules` is replaced, inside the block, by a
    bf16 copy made once on entry (tied weights stay tied: one copy per
    parameter object); a hook moves each copy's gradient into the fp32
    master's `.grad` as soon as a backward produces it, so gradients of
    successive micro-batches accumulate in fp32, as FSDP's fp32 reduction
    does. On exit the masters are back; clip and step after the block. fp32,
    or N ranks: nothing.
    """
    if precision != "bf16" or ranks.sharded:
        yield
        return
    copies: dict[int, nn.Parameter] = {}
    swapped: list[tuple[dict, str, nn.Parameter]] = []
    try:
        for module in (m for m in modules if m is not None):
            for sub in module.modules():
                for name, master in list(sub._parameters.items()):
                    if master is None or not master.is_floating_point() or master.dtype == torch.bfloat16:
                        continue
                    if id(master) not in copies:
                        copy = nn.Parameter(master.detach().to(torch.bfloat16), requires_grad=master.requires_grad)
                        if master.requires_grad:
                            copy.register_post_accumulate_grad_hook(_to_master(master))
                        copies[id(master)] = copy
                    swapped.append((sub._parameters, name, master))
                    sub._parameters[name] = copies[id(master)]
        yield
    finally:
        for params, name, master in swapped:
            params[name] = master
