"""Decode attention over the paged KV cache: every sequence of a batch in one call.

A decode step has one new query per sequence; sequence b attends to the
`lengths[b]` positions its block table `tables[b]` holds in the pool and to its
own new key (stored into the pool after the whole forward, so this call only
reads the pool). Positions past a sequence's length, and the padding blocks that
make a batch's tables one rectangle, are masked.

Two implementations of the same arithmetic:

- `decode_attention`, written as a gather, products and sums that
  `torch.compile` fuses into one loop nest per layer (on a CPU, C++ with
  OpenMP; on a GPU, Triton): the cache is read in place through the block
  table, nothing is materialised per sequence, and there is no Python loop
  over sequences. This is what `PagedDecodeAttention` runs by default.
- `decode_attention_eager`, the same with the gathered keys materialised and
  two batched matrix products: for machines where compiling is not possible
  (no C++ compiler) or is turned off. It is several times slower at large
  batches.

Scores, softmax and the weighted sum are fp32 whatever the cache's dtype (the
keys are widened as they are read).

Padding costs reads and arithmetic, so a batch of very different lengths is
cut into groups of alike lengths (`length_groups`), each its own call.

Shape legend: B sequences, K key/value heads, G query heads per key/value head,
D head dim, R pool rows (P blocks of S positions), N blocks per table, T = N * S.
"""

from __future__ import annotations

import logging
import shutil

import torch

log = logging.getLogger(__name__)

def is_compile_error(exc: BaseException) -> bool:
    """Whether `exc` is what a failed `torch.compile` raises (a missing or broken C++ toolchain), not
    a bug of ours. torch's compiler modules are imported here, not at import: they import Triton,
    which reads its settings once."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return isinstance(exc, (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InvalidCxxCompiler,
                            torch._inductor.exc.CppCompileError))

PADDING_SLACK = 0.25
"""A group of sequences padded to its longest may compute at most this fraction more positions
than its sequences hold (`length_groups`)."""
MAX_GROUPS = 4
SHORT = 256
"""Below this many positions a batch is one group: padding costs less than another call."""


def decode_attention(q_BKGD: torch.Tensor, k_BKD: torch.Tensor, v_BKD: torch.Tensor, k_KRD: torch.Tensor,
                     v_KRD: torch.Tensor, tables_BN: torch.Tensor, lengths_B: torch.Tensor, block: int,
                     siblings_BB: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's query (already scaled) over its cached positions and its own
    new key and value; returns [B, K, G, D] in fp32. The form `torch.compile` fuses.

    `siblings_BB` (bool, None: the diagonal): which rows' new keys row b also attends to — a
    verification pass puts a sequence's last token and its drafts in consecutive rows, each seeing
    the cache and the rows up to its own."""
    K, _, D = k_KRD.shape
    N = tables_BN.shape[1]
    q_BKGD = q_BKGD.float()
    k_KBTD = k_KRD.view(K, -1, block, D)[:, tables_BN].flatten(2, 3)
    v_KBTD = v_KRD.view(K, -1, block, D)[:, tables_BN].flatten(2, 3)
    scores_BKGT = (q_BKGD[:, :, :, None, :] * k_KBTD.permute(1, 0, 2, 3)[:, :, None].float()).sum(-1)
    past_BT = torch.arange(N * block, device=q_BKGD.device)[None, :] >= lengths_B[:, None]
    scores_BKGT = scores_BKGT.masked_fill(past_BT[:, None, None, :], float("-inf"))
    if siblings_BB is None:
        own_BKG1 = (q_BKGD * k_BKD[:, :, None].float()).sum(-1, keepdim=True)
        top_BKG1 = torch.maximum(scores_BKGT.amax(-1, keepdim=True), own_BKG1)
        weights_BKGT = torch.exp(scores_BKGT - top_BKG1)
        own_BKG1 = torch.exp(own_BKG1 - top_BKG1)
        total_BKG1 = weights_BKGT.sum(-1, keepdim=True) + own_BKG1
        out_BKGD = (weights_BKGT[..., None] * v_KBTD.permute(1, 0, 2, 3)[:, :, None].float()).sum(-2)
        return (out_BKGD + own_BKG1 * v_BKD[:, :, None].float()) / total_BKG1
    new_BKGC = (q_BKGD[:, :, :, None, :] * k_BKD.permute(1, 0, 2)[None, :, None].float()).sum(-1)
    new_BKGC = new_BKGC.masked_fill(~siblings_BB[:, None, None, :], float("-inf"))
    top_BKG1 = torch.maximum(scores_BKGT.amax(-1, keepdim=True), new_BKGC.amax(-1, keepdim=True))
    weights_BKGT = torch.exp(scores_BKGT - top_BKG1)
    new_BKGC = torch.exp(new_BKGC - top_BKG1)
    total_BKG1 = weights_BKGT.sum(-1, keepdim=True) + new_BKGC.sum(-1, keepdim=True)
    out_BKGD = (weights_BKGT[..., None] * v_KBTD.permute(1, 0, 2, 3)[:, :, None].float()).sum(-2)
    out_BKGD = out_BKGD + (new_BKGC[..., None] * v_BKD.permute(1, 0, 2)[None, :, None].float()).sum(-2)
    return out_BKGD / total_BKG1


def decode_attention_eager(q_BKGD: torch.Tensor, k_BKD: torch.Tensor, v_BKD: torch.Tensor, k_KRD: torch.Tensor,
                           v_KRD: torch.Tensor, tables_BN: torch.Tensor, lengths_B: torch.Tensor, block: int,
                           siblings_BB: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` with the gathered keys materialised and batched matrix products."""
    K, _, D = k_KRD.shape
    N = tables_BN.shape[1]
    B = q_BKGD.shape[0]
    q_BKGD = q_BKGD.float()
    k_BKTD = k_KRD.view(K, -1, block, D)[:, tables_BN].flatten(2, 3).transpose(0, 1).float()
    v_BKTD = v_KRD.view(K, -1, block, D)[:, tables_BN].flatten(2, 3).transpose(0, 1).float()
    if siblings_BB is None:   # the new key as position T: one softmax over the cache and itself
        k_BKTD = torch.cat([k_BKTD, k_BKD[:, :, None].float()], dim=2)
        v_BKTD = torch.cat([v_BKTD, v_BKD[:, :, None].float()], dim=2)
        past_BT = torch.arange(N * block + 1, device=q_BKGD.device)[None, :] >= lengths_B[:, None]
        past_BT[:, -1] = False
    else:                     # every row's new key after the cache, masked to the row's siblings
        k_BKTD = torch.cat([k_BKTD, k_BKD.permute(1, 0, 2)[None].expand(B, -1, -1, -1).float()], dim=2)
        v_BKTD = torch.cat([v_BKTD, v_BKD.permute(1, 0, 2)[None].expand(B, -1, -1, -1).float()], dim=2)
        past_BT = torch.cat([torch.arange(N * block, device=q_BKGD.device)[None, :] >= lengths_B[:, None],
                             ~siblings_BB], dim=1)
    scores_BKGT = torch.matmul(q_BKGD, k_BKTD.transpose(2, 3))
    scores_BKGT.masked_fill_(past_BT[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores_BKGT, dim=-1), v_BKTD)


def length_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Cut a batch sorted by length, longest first, into `(start, end)` slices that are each padded
    to their first (longest) member: a new slice begins where padding would pass `PADDING_SLACK`,
    at most `MAX_GROUPS` slices, one when the longest is under `SHORT` positions."""
    if not lengths or lengths[0] < SHORT:
        return [(0, len(lengths))]
    groups, start, held = [], 0, 0
    for b, n in enumerate(lengths):
        padded, held_then = (b + 1 - start) * lengths[start], held + n
        if b > start and len(groups) < MAX_GROUPS - 1 and padded > (1 + PADDING_SLACK) * held_then:
            groups.append((start, b))
            start, held = b, 0
        held += n
    groups.append((start, len(lengths)))
    return groups


def can_compile(device: torch.device) -> bool:
    """Whether `torch.compile` can build kernels here: a GPU, or a CPU with a C++ compiler."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


class PagedDecodeAttention:
    """`decode_attention`, compiled on first use when `compile` is true (the default where a
    compiler is found), else the eager form. A compile that fails (a broken toolchain) is logged
    once and the eager form serves from then on: the same arithmetic, slower."""

    def __init__(self, device: torch.device, compile: bool | None = None) -> None:
        self.compiled = can_compile(device) if compile is None else compile
        # Static shapes but for the batch and the tables' width: every other size is the model's,
        # and kernels specialised to them (head dim, block) vectorise far better than symbolic ones.
        self._fn = torch.compile(decode_attention, dynamic=False) if self.compiled else decode_attention_eager

    def __call__(self, q_BKGD, k_BKD, v_BKD, k_KRD, v_KRD, tables_BN, lengths_B, block: int,
                 siblings_BB=None) -> torch.Tensor:
        args = (q_BKGD, k_BKD, v_BKD, k_KRD, v_KRD, tables_BN, lengths_B, block, siblings_BB)
        if not self.compiled:
            return decode_attention_eager(*args)
        for t in (q_BKGD, k_BKD, v_BKD, tables_BN, lengths_B):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(tables_BN, 1)
        if siblings_BB is not None:
            torch._dynamo.maybe_mark_dynamic(siblings_BB, 0)
            torch._dynamo.maybe_mark_dynamic(siblings_BB, 1)
        try:
            return self._fn(*args)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            log.warning("compiling decode attention failed (%s: %s); running it eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.compiled = False
            return decode_attention_eager(*args)
