"""Data-parallel ranks on PyTorch's own engine: process groups, FSDP2, bf16, balanced packing.

Legend: B = sequences, T = tokens, C = tokens in one logprob chunk, V = vocabulary, H = hidden.

The trainers (`atelier.rl.trainer`, `atelier.pretrain.train`) call these
functions and never branch on the number of ranks themselves:

- `init_ranks(device, timeout_s)` reads torchrun's environment contract
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and joins the
  process group: NCCL on CUDA, gloo on the CPU. Every collective inherits
  `timeout_s`: a rank that dies or hangs makes the others raise instead of
  waiting forever (PITFALLS: collectives with no timeout hung the job). With
  WORLD_SIZE unset or 1 nothing is initialised and the model is left
  unwrapped: one rank is exactly the single-process trainer. A rank's whole
  run sits inside `joined_ranks(...)`, which leaves the group when the run
  ends, and a rank's process ends with `exit_rank(code)`, without the
  interpreter's teardown, where gloo's threads can abort a finished rank.
- `PolicyHead` wraps a Hugging Face causal LM so that one forward returns the
  per-token logprobs (and entropy) of the given ids, computed over chunks of
  C tokens (`atelier.kernels.logprobs`, its own checkpoint): the fp32
  [B, T, V] log-softmax is never in memory, only [C, V] blocks, in the
  forward and in the backward (PITFALLS: a whole-vocabulary fp32 log-softmax
  ran trainers out of memory).
- `shard(head, ranks, precision)` applies `fully_shard` to every decoder
  layer and then to the head (the root, which owns embeddings, final norm and
  lm_head, tied or not), with `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` for bf16: compute in bf16, fp32 master weights, fp32
  gradient reduction. FSDP averages gradients over ranks; the trainers
  multiply each backward by `grad_scale(ranks)` (the world size) so the
  reduction is a *sum*: the losses divide by one global constant, and the sum
  over ranks of each rank's gradient is the one-rank gradient (PITFALLS:
  per-rank normalisation changes the objective with the number of ranks).
  (FSDP's own divide factor needs NCCL's PreMulSum, which gloo lacks.) On one rank
  `compute_weights` does what that policy does, without a process group: for
  one optimizer step it swaps bf16 copies of the fp32 master weights into the
  modules (cast once per step, not at every use as `torch.autocast` does, which
  measured slower than fp32 on one rank), and adds each backward's bf16
  gradients into the masters' fp32 `.grad`; the masters, the optimizer, state
  dicts and checkpoints never see a bf16 tensor.
- `balanced_partition(lengths, world)` packs a step's samples into per-rank
  lists of nearly equal token counts (longest first onto the lightest rank,
  the report's global sequence packing); `micro_batches` then cuts each
  rank's list into micro-batches, and every rank runs the *same number* of
  forward/backward passes (FSDP's collectives need that), padding with empty
  micro-batches whose loss mask is all zero.
- `full_state_dict(model)` gathers the full, unsharded weights on rank 0 (for
  publishing to inference and for Hugging Face checkpoints); the other ranks
  get an empty dict. `save_sharded` / `load_sharded` write and read model and
  optimizer with `torch.distributed.checkpoint` (each rank its own shards).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.nn as nn

from atelier.errors import AtelierError

DEFAULT_TIMEOUT_S = 600.0
LOGPROB_CHUNK = 512


class DistributedError(AtelierError):
    """A rank died, a collective timed out, or the ranks were set up wrong."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """'auto' takes the GPU when torch sees one; rank r uses GPU r of its node."""
    if choice not in ("auto", "cpu", "cuda"):
        raise AtelierError(f"unknown device {choice!r}", hint="use auto, cpu or cuda")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise AtelierError('device = "cuda" but torch sees no GPU', hint='use device = "auto" or "cpu"')
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' is bf16 on a GPU that has it and fp32 on the CPU, where the built-in sampler
    computes in fp32 (ask for "bf16" explicitly: AMX CPUs run it fast)."""
    if precision in ("fp32", "bf16"):
        return precision
    if precision != "auto":
        raise AtelierError(f"unknown precision {precision!r}", hint="use auto, fp32 or bf16")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
    """Join the process group named by torchrun's environment variables (none: one rank).

    Every trainer process (RL, pretrain/SFT) starts here, so on the CPU this is also where
    it calls `return_freed_memory`, before any weight or activation is allocated.
    """
    import torch.distributed as dist

    world = env_world()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dev = pick_device(device, local_rank)
    if dev.type == "cpu":
        return_freed_memory()   # activations' freed memory does not stay resident
    if world > 1 and not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise DistributedError(f"WORLD_SIZE={world} but {key} is not set",
                                       hint="start the ranks with `atelier train --set trainer.ranks=N` "
                                            "or torchrun, which set the rendezvous")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Ranks(rank, world, local_rank, dev)


def close_ranks() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def joined_ranks(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[Ranks]:
    """`init_ranks` for the length of a run; the group is left when the block ends, as
    PyTorch asks of every process once its collectives are done (so a process that runs
    again, a Ray actor, joins a new group instead of finding a finished one)."""
    ranks = init_ranks(device, timeout_s)
    try:
        yield ranks
    finally:
        close_ranks()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with `code`, skipping the interpreter's teardown (as
    multiprocessing's children end): atexit handlers run and output is flushed first.

    gloo's worker threads free each finished collective's tensors after the collective has
    returned; one that does so once the interpreter is tearing down cannot take the GIL and
    aborts the process ("terminate called without an active exception", SIGABRT), so a rank
    that had finished its work read as failed: 5 of about 200 two-rank test runs here (gdb:
    gloo's run-loop thread in `~AsyncAllgatherCoalescedWork`, the main thread in
    `Py_FinalizeEx`). Leaving the group does not stop those threads: DTensor's caches keep the
    group alive.
    """
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


# --- the model: chunked logprobs behind one forward -----------------------------

def chunked_token_logprobs(hidden_BTH: torch.Tensor, lm_head: nn.Linear, ids_BT: torch.Tensor,
                           temperature: float, want_entropy: bool = False,
                           chunk: int = LOGPROB_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[t] | ids[<t]) from the final hidden states, C tokens of the batch at a time.

    Position 0 gets 0 (nothing predicts it). The B sequences are flattened into
    one list of tokens and cut into chunks of C (`atelier.kernels.logprobs`,
    which recomputes each chunk's logits in the backward), so memory holds a
    few [C, V] fp32 blocks whatever B is.
    """
    from atelier.kernels.logprobs import chunked_logprobs

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
                              **{_cache_keyword(type(base)): prefix.cache(B)}).last_hidden_state
        return chunked_token_logprobs(hidden_BTH, self.lm.get_output_embeddings(), ids_BT, temperature,
                                      want_entropy, self.chunk)

    def encode_prefix(self, ids_1P: torch.Tensor, recompute: bool = False, *, parent: SharedPrefix | None = None,
                      labels_1P: torch.Tensor | None = None, temperature: float = 1.0) -> SharedPrefix:
        """The key/value cache of a run of tokens that sequences continue, in this forward's autograd
        graph (unless under no_grad). With `parent`, the run itself continues the parent's (a node
        of `atelier.rl.prefix_tree`); with `labels_1P`, the token after each of `ids_1P`, the run
        also gives their logprobs and entropy (`SharedPrefix.logprobs_1P`, `entropy_1P`).

        With `recompute`, the forward runs without a graph and `SharedPrefix.backward` runs it
        again with one (activation checkpointing of the run alone): the run's activations are
        not held while its continuations run.

        Not for a sharded head: FSDP unshards a layer for its backward when the gradient reaches
        the layer's output, and a prefix's gradient reaches its layers through their keys and
        values instead (the trainer shares prefixes on one rank only).
        """
        base = decoder_of(self.lm)
        past = parent.length if parent is not None else 0

        def run() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None, torch.Tensor | None]:
            from atelier.prefix_cache import PrefixCache

            cache = parent.cache(1, keep=True) if parent is not None else PrefixCache(self.lm.config, keep=True)
            hidden_1PH = base(input_ids=ids_1P, attention_mask=ids_1P.new_ones(1, past + ids_1P.shape[1]),
                              use_cache=False, **{_cache_keyword(type(base)): cache}).last_hidden_state
            if labels_1P is None:
                return cache.kept_keys_and_values(), None, None
            from atelier.kernels.logprobs import chunked_logprobs

            head = self.lm.get_output_embeddings()
            logp_N, ent_N = chunked_logprobs(hidden_1PH.reshape(-1, hidden_1PH.shape[-1]), head.weight, head.bias,
                                             labels_1P.reshape(-1), temperature, self.chunk, True)
            return cache.kept_keys_and_values(), logp_N.view(1, -1), ent_N.view(1, -1)

        if not (recompute and torch.is_grad_enabled()):
            return SharedPrefix(past + ids_1P.shape[1], *run(), self.lm.config)
        rng = _rng_states(ids_1P.device)
        with torch.no_grad():
            kept = run()

        def again():
            with _rng_restored(ids_1P.device, rng):   # the same dropout masks, if the model has any
                return run()

        return SharedPrefix(past + ids_1P.shape[1], *kept, self.lm.config, recompute=again)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _rng_restored(device: torch.device, states: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run the block from RNG `states` (as `_rng_states` took them); the RNGs are as before after it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1], device)
        yield


@functools.cache
def _cache_keyword(decoder_type: type) -> str:
    """transformers 5.20 renamed `past_key_values` to `cache` (the vLLM environment pins an earlier
    one). Cached per decoder class: read once, not at every micro-batch."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder_type.forward).parameters else "past_key_values"


class SharedPrefix:
    """A run of tokens that sequences of a trainer step continue, run forward once for all of them.

    A step's RL samples share their first ~1,200 tokens (the harness's system
    prompt), and a group's members their task and often their first turns
    (`atelier.rl.prefix_tree`): running them once instead of once per sample
    is most of a step's compute on this recipe. The continuations attend to
    detached copies of the run's keys and values (`leaves`), whose gradients
    collect over every continuation's backward; `backward()` then sends them
    through the run's forward once, with the loss of the run's own trained
    tokens. The result is the gradient of running every sample whole, up to
    rounding (tests/rl/test_trainer.py). With `recompute` (the trainer's
    `recompute_prefix`), that forward is run again for the backward instead
    of being kept: the run's activations (about 1.3 GB for SmolLM2-135M's
    1,200 tokens in bf16) are not held while every continuation runs, for one
    more forward of the run a step. `length` counts every position the
    continuations read: the parent's too.
    """

    def __init__(self, length: int, kv: list[tuple[torch.Tensor, torch.Tensor]], logprobs_1P: torch.Tensor | None,
                 entropy_1P: torch.Tensor | None, config: Any, recompute: Callable[[], tuple] | None = None) -> None:
        self.length, self.kv, self.config, self.recompute = length, kv, config, recompute
        self.logprobs_1P, self.entropy_1P = logprobs_1P, entropy_1P
        self.leaves = [tuple(t.detach().requires_grad_(t.requires_grad or recompute is not None) for t in pair)
                       for pair in kv]

    def cache(self, batch: int, keep: bool = False):
        """A cache over the leaves for `batch` continuations, which they read and never grow (so a
        checkpointed layer can be recomputed: `atelier.prefix_cache`); with `keep`, it records what
        a continuation's forward adds (for a run that continues this one)."""
        from atelier.prefix_cache import PrefixCache

        return PrefixCache(self.config, [tuple(t.expand(batch, -1, -1, -1) for t in pair) for pair in self.leaves],
                           keep=keep)

    def backward(self, loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Send the continuations' gradients through the run's forward, with `loss_of(logprobs_1P)`,
        the loss of the run's own trained tokens, when given (computed on the recomputed logprobs
        under `recompute`)."""
        if loss_of is None and not any(leaf.grad is not None for pair in self.leaves for leaf in pair):
            return
        kv, logprobs_1P, _ = self.recompute() if self.recompute is not None else (self.kv, self.logprobs_1P, None)
        outputs, grads = [], []
        for pair, leaves in zip(kv, self.leaves):
            for out, leaf in zip(pair, leaves):
                if leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if loss_of is not None:
            outputs.append(loss_of(logprobs_1P))
            grads.append(None)   # a scalar: d loss / d loss = 1
        if outputs:
            torch.autograd.backward(outputs, grads)


def decoder_of(lm: nn.Module) -> nn.Module:
    """The causal LM's body (embeddings, layers, final norm), without its output head."""
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


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
            # The only caches a policy's forward is given are PrefixCaches, which are read, never
            # grown: transformers may keep them under checkpointing (else it drops the shared prefix)
            layer._can_checkpoint_with_cache = True
    if not ranks.sharded:
        return head.to(ranks.device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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


# --- balanced steps --------------------------------------------------------------

def balanced_partition(lengths: list[int], world: int) -> list[list[int]]:
    """Indices per rank, longest first onto the rank with the fewest tokens (ties: lowest rank).

    Deterministic, so every rank computes the same partition from the same batch.
    """
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def micro_batches(indices: list[int], size: int, count: int) -> list[list[int]]:
    """`indices` cut into `count` micro-batches of at most `size`; the tail ones may be empty."""
    out = [indices[i:i + size] for i in range(0, len(indices), size)]
    if len(out) > count:
        raise ValueError(f"{len(indices)} samples do not fit {count} micro-batches of {size}")
    return out + [[] for _ in range(count - len(out))]


def step_plan(lengths: list[int], world: int, rank: int, micro_batch: int) -> list[list[int]]:
    """This rank's micro-batches (indices into the step's samples); the same count on every rank."""
    parts = balanced_partition(lengths, world)
    count = max(1, max(-(-len(p) // micro_batch) for p in parts))
    return micro_batches(parts[rank], micro_batch, count)


# --- collectives -------------------------------------------------------------------

def all_reduce_sum(values: list[float], ranks: Ranks) -> list[float]:
    if not ranks.sharded:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: list[float], ranks: Ranks) -> list[float]:
    if not ranks.sharded:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_object(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank (pickled; the small per-step messages of the launcher)."""
    if not ranks.sharded:
        return obj
    import torch.distributed as dist

    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0, device=ranks.device if ranks.device.type == "cuda" else None)
    return box[0]


def barrier(ranks: Ranks) -> None:
    if ranks.sharded:
        import torch.distributed as dist

        dist.barrier()


HEAP_MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc serves an allocation with its own mmap (see `return_freed_memory`)."""


def return_freed_memory() -> bool:
    """Have glibc hand large freed CPU tensors back to the OS at once; False where it is not glibc.

    glibc serves allocations under its mmap threshold from its heaps and keeps
    what is freed there for reuse. The threshold starts at 128 KiB but rises to
    the size of every mmapped block freed, up to 32 MiB, so after the first
    step a trainer's activations (tens of MiB each at thousands of tokens)
    come from the heaps, and their freed holes stay resident beside the next
    ones. Fixing the threshold (and the heap trim threshold) at 1 MiB maps
    every large tensor and unmaps it when freed. Measured on the RL trainer,
    bf16, 4 layers of SmolLM2-135M at 4 x 1,024 tokens: peak RSS 1.564 ->
    1.423 GiB, step time the same within one run. Process-wide, like the
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ variables it stands for.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, HEAP_MMAP_THRESHOLD)
                and libc.mallopt(m_trim_threshold, HEAP_MMAP_THRESHOLD))


def trim_freed_memory() -> bool:
    """Hand back to the OS what glibc's heaps hold freed (`malloc_trim`); False where it is not glibc.

    `return_freed_memory` maps large tensors on their own, but a step also frees many
    allocations under its threshold, in the heaps of every thread that made them (the RL
    stage's engine and rollout workers share the trainer's process). glibc trims a heap
    only from its top, so what is freed beneath a live allocation stays resident and the
    resident set grew step after step: the RL trainer alone, bf16, 4 samples of about
    1,450 tokens, rested at 2.93, 3.26, 3.58, 3.85, 3.99 GiB after steps 1-5, and at
    2.64 GiB after each with this called after the step (it costs milliseconds).
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)   # its result only says whether it found pages to return
    return True


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm (across shards and ranks) and clipping; DTensor-aware."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --- weights out and checkpoints ----------------------------------------------------

def full_state_dict(module: nn.Module, ranks: Ranks, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0, on the CPU (empty on other ranks).

    Collective when sharded: every rank must call it.
    """
    if ranks.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def save_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state with torch.distributed.checkpoint: each rank writes its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def unwrap(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a `PolicyHead` (for save_pretrained, config, generation)."""
    return module.lm if isinstance(module, PolicyHead) else module


@contextlib.contextmanager
def named_failure(what: str) -> Iterator[None]:
    """Turn a collective's failure (a dead or hung rank) into a `DistributedError` that says so."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        text = str(exc)
        markers = ("Connection closed", "Connection reset", "connection", "timed out", "Timed out",
                   "Timeout", "Broken pipe", "NCCL communicator", "peer")
        if any(m in text for m in markers):
            raise DistributedError(f"{what}: another rank died or stopped answering ({text.splitlines()[0]})",
                                   hint="the whole job stops; continue it with --resume RUN_DIR") from exc
        raise
