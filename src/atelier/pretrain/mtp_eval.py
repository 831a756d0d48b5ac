"""`atelier mtp eval`: a model's MTP heads measured on held-out code, without an engine.

Two measures of greedy acceptance (atelier.mtp.acceptance), both teacher-forced in one forward
per row:

- `text`: on held-out code itself (the first `tokens` tokens of the repositories, in rows of
  `seq_len`): the heads are fed the text's tokens, the main head's argmax is the reference.
  Cheap, and what the training logs.
- `greedy`: on the model's own greedy continuations of `prompts` prompts of `prompt_len` tokens
  cut from the same code (`new_tokens` each, counted from the first generated token). There the
  tokens the heads are fed are the main head's choices, as in greedy speculative decoding, so
  the figures are what a greedy verifier would accept, start by start.
- `chat` (with `chats`, JSONL files of {"messages": [...]}, as `atelier mtp generate --split
  heldout` writes): on the assistant turns of each conversation, the rest its context. On the
  model's own replies this is what speculation meets when it serves them.
- `rollouts` (with `trajectories`, directories of harness trajectories: an RL run's rollouts,
  an evaluation's): on each segment's sampled tokens, every reward counted.

The repositories default to the held-out ones the training run recorded in mtp.json. A draft is
the head's argmax over the first `draft_vocab` token ids (those the heads were distilled on, or
any other number asked for), compared with the model's argmax over the whole vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from atelier.mtp.acceptance import Acceptance
from atelier.mtp.heads import MTPError
from atelier.mtp.policy import MTPPolicyHead
from atelier.mtp.store import load_mtp_heads
from atelier.pretrain.modeling import load_model_and_tokenizer, resolve_model_path
from atelier.pretrain.perplexity import EvalError, repo_text
from atelier.pretrain.sft_data import Example, load_chat, load_trajectories
from atelier.train.devices import cpu_has_bf16


def evaluate_heads(model_spec: str, repos: Sequence[str | Path] = (), *, tokens: int = 8192, seq_len: int = 1024,
                   prompts: int = 4, prompt_len: int = 256, new_tokens: int = 128,
                   include: Sequence[str] = ("**/*.py",), device: str = "cpu", dtype: str = "auto",
                   draft_vocab: int | None = None, chats: Sequence[str | Path] = (),
                   trajectories: Sequence[str | Path] = ()) -> dict[str, Any]:
    """The acceptance measures of the heads in `model_spec` (see the module docstring). The heads
    draft from the first `draft_vocab` ids (None: those mtp.json says they were distilled on; 0: the
    whole vocabulary), as an engine that drafts from them would."""
    model_dir = resolve_model_path(model_spec)
    model, tokenizer = load_model_and_tokenizer(str(model_dir), device)
    heads = load_mtp_heads(model_dir, model)
    if heads is None:
        raise MTPError(f"{model_dir} has no MTP heads (no mtp.json)",
                       hint="attach heads first: atelier mtp attach recipes/mtp-attach-smollm2.toml --out DIR")
    repos = [str(r) for r in repos] or list(heads.info.get("heldout_repos") or [])
    if not repos and not chats and not trajectories:
        raise EvalError(f"no held-out code to measure {model_dir}'s heads on (mtp.json names none)",
                        hint="pass --repo DIR (code the heads and the model did not train on), --chat FILE "
                             "or --trajectories DIR")
    ids = _token_stream(tokenizer, repos, include, max(tokens, prompts * prompt_len))
    conversations = load_chat(chats, tokenizer)
    segments = load_trajectories(trajectories, min_reward=-math.inf)
    compute = _compute_dtype(dtype, device)
    model.to(compute)
    heads.to(compute)
    vocab = heads.draft_vocab if draft_vocab is None else (draft_vocab or None)
    policy = MTPPolicyHead(model, heads, "frozen", vocab=vocab).eval()
    with torch.no_grad():
        text = _acceptance(policy, [_skipping(row, 1) for row in _rows(ids[:tokens], seq_len)], device) if ids else None
        greedy = _greedy(policy, ids, prompts, prompt_len, new_tokens, device) if ids else None
        chat = _on_examples(policy, conversations, device)
        rollouts = _on_examples(policy, segments, device)
    return {"model": str(model_dir), "heads": len(heads), "tokens_seen": heads.tokens_seen,
            "dtype": str(compute).removeprefix("torch."), "draft_vocab": vocab, "repos": repos,
            "training": heads.info,
            "text": text and {**text, "tokens": min(tokens, len(ids))}, "greedy": greedy,
            "chat": chat and {**chat, "conversations": len(conversations)},
            "rollouts": rollouts and {**rollouts, "segments": len(segments)}}


def _token_stream(tokenizer, repos: Sequence[str], include: Sequence[str], limit: int) -> list[int]:
    ids: list[int] = []
    for repo in repos:
        ids += tokenizer(repo_text(repo, include), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= limit:
            break
    return ids


def _compute_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        fast = torch.cuda.is_bf16_supported() if device.startswith("cuda") else cpu_has_bf16()
        return torch.bfloat16 if fast else torch.float32
    choices = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if dtype not in choices:
        raise EvalError(f"unknown dtype {dtype!r}", hint="use auto, fp32 or bf16")
    return choices[dtype]


def _rows(ids: list[int], seq_len: int) -> list[torch.Tensor]:
    return [torch.tensor(ids[s:s + seq_len])[None] for s in range(0, len(ids), seq_len) if len(ids) - s > 2]


def _skipping(row: torch.Tensor, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row` and the mask that leaves its first `skip` positions as context only."""
    mask = torch.ones_like(row)
    mask[:, :skip] = 0
    return row, mask


def _on_examples(policy: MTPPolicyHead, examples: Sequence[Example], device: str) -> dict[str, Any] | None:
    """Acceptance over the masked tokens of `examples` (None: there are none)."""
    if not examples:
        return None
    rows = [(torch.tensor([e.token_ids]), torch.tensor([e.loss_mask])) for e in examples]
    return {**_acceptance(policy, rows, device), "tokens": sum(sum(e.loss_mask) for e in examples)}


def _acceptance(policy: MTPPolicyHead, rows: list[tuple[torch.Tensor, torch.Tensor]], device: str) -> dict[str, Any]:
    """Acceptance over `rows`, each ([1, T] ids, [1, T] mask of the tokens measured)."""
    total, kl, weights = Acceptance(len(policy.mtp)), [0.0] * len(policy.mtp), [0.0] * len(policy.mtp)
    for row, mask in rows:
        ids = row.to(device)
        _, out = policy(ids, torch.ones_like(ids), mtp_mask=mask.to(device))
        total.merge(out.acceptance)
        kl = [a + b for a, b in zip(kl, out.kl_sums)]
        weights = [a + b for a, b in zip(weights, out.weight_sums)]
    return {**total.to_dict(), "kl": [k / max(w, 1.0) for k, w in zip(kl, weights)]}


def _greedy(policy: MTPPolicyHead, ids: list[int], prompts: int, prompt_len: int, new_tokens: int,
            device: str) -> dict[str, Any] | None:
    """Acceptance on greedy continuations of prompts spread evenly over `ids`."""
    if prompts == 0 or new_tokens < 2 or len(ids) < prompt_len:
        return None
    step = (len(ids) - prompt_len) // max(prompts - 1, 1)
    batch = torch.tensor([ids[i * step:i * step + prompt_len] for i in range(prompts)], device=device)
    lm = policy.lm
    # eos_token_id=None: continue past an end-of-text token, so every row is the model's greedy text
    out = lm.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                      max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=lm.config.pad_token_id or 0)
    # skip P + 1: the first step starts at the prompt's last position (trunk state h_{P-1}, the first
    # generated token t_P), whose first draft is t_{P+1}; head k's rows then start at teacher j = P
    result = _acceptance(policy, [_skipping(row[None], prompt_len + 1) for row in out], device)
    return {**result, "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens}
