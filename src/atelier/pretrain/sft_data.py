"""SFT examples: chat transcripts and harness trajectories as (token ids, loss mask).

Chat: the model's chat template renders the conversation; the loss covers
only what an assistant turn adds after its generation header (its content and
end-of-turn token). Each rendered piece is tokenized on its own, so the mask
lines up exactly with the tokens even when the template is not a clean
prefix-extension; a template that rewrites earlier turns is refused.

Trajectories: the harness stores the exact sampled token ids with a loss
mask (1 on sampled tokens, 0 on prompt and tool output), the same buffers RL
trains on. SFT on them uses that mask as is, so it teaches the very
tool-call format the RL phase samples. Only episodes with reward >=
`min_reward` are kept (rejection sampling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from atelier.errors import AtelierError
from atelier.harness.trajectory import Trajectory


class SFTDataError(AtelierError):
    """Chat or trajectory data that cannot become SFT examples."""


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[int]


def chat_example(tokenizer, messages: list[dict[str, Any]]) -> Example:
    """Tokens of a conversation with the loss on assistant turns only."""
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen)
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            header = render(messages[:i], True) if i else render([], True)
            _append(tokenizer, ids, mask, done, header, 0)
            done = header
        full = render(messages[: i + 1])
        _append(tokenizer, ids, mask, done, full, 1 if message.get("role") == "assistant" else 0)
        done = full
    return Example(ids, mask)


def _append(tokenizer, ids: list[int], mask: list[int], done: str, text: str, value: int) -> None:
    if not text.startswith(done):
        raise SFTDataError("the chat template rewrites earlier turns, so assistant tokens cannot be "
                           "masked exactly", hint="use a model whose template only appends (e.g. ChatML)")
    piece = tokenizer(text[len(done):], add_special_tokens=False)["input_ids"]
    ids.extend(piece)
    mask.extend([value] * len(piece))


def load_chat(paths: Iterable[str | Path], tokenizer) -> list[Example]:
    examples = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise SFTDataError(f"chat file {path} does not exist", hint="sft chat = [\"file.jsonl\", ...]")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                assert isinstance(messages, list) and all("role" in m and "content" in m for m in messages)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
                raise SFTDataError(f"{path}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}",
                                   hint="one conversation per line, in JSON") from None
            examples.append(chat_example(tokenizer, messages))
    return examples


def trajectory_examples(trajectories: Iterable[Any], min_reward: float = 1.0) -> list[Example]:
    """One example per segment of each trajectory with reward >= min_reward."""
    examples = []
    for traj in trajectories:
        if traj.reward is None or traj.reward < min_reward:
            continue
        for seg in traj.segments:
            if len(seg.token_ids) != len(seg.loss_mask):
                raise SFTDataError(f"trajectory {traj.task_id}: token_ids and loss_mask differ in length")
            if any(seg.loss_mask):
                examples.append(Example(list(seg.token_ids), list(seg.loss_mask)))
    return examples


def load_trajectories(directories: Iterable[str | Path], min_reward: float = 1.0) -> list[Example]:
    loaded = []
    for directory in directories:
        directory = Path(directory)
        if not directory.is_dir():
            raise SFTDataError(f"trajectory directory {directory} does not exist",
                               hint="point trajectories at directories of trajectory JSON files")
        for path in sorted(directory.rglob("*.json")):
            try:
                loaded.append(Trajectory.load(path))
            except (json.JSONDecodeError, TypeError, KeyError) as exc:
                raise SFTDataError(f"{path} is not a trajectory: {exc}") from None
    return trajectory_examples(loaded, min_reward)


def pack_examples(examples: Sequence[Example], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedily pack examples into rows of `seq_len`; return ids_NS and mask_NS.

    Examples keep their order and are never split across rows; one longer
    than a row is cut to its first `seq_len` tokens. Padding has mask 0.
    """
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    mask: list[int] = []
    for ex in examples:
        e_ids, e_mask = ex.token_ids[:seq_len], ex.loss_mask[:seq_len]
        if not any(e_mask[1:]):
            continue  # nothing left to learn once cut (position 0 is never predicted)
        if len(ids) + len(e_ids) > seq_len:
            rows.append((ids, mask))
            ids, mask = [], []
        ids = ids + e_ids
        mask = mask + e_mask
    if ids:
        rows.append((ids, mask))
    if not rows:
        longest = max((len(ex.token_ids) for ex in examples), default=0)
        raise SFTDataError(
            f"no SFT example has a trained token within seq_len = {seq_len} "
            f"({len(examples)} examples, the longest {longest} tokens)",
            hint="raise the phase's seq_len above the examples' prompt length, or check the data and min_reward")
    ids_NS = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    mask_NS = np.zeros((len(rows), seq_len), dtype=np.int64)
    for i, (r_ids, r_mask) in enumerate(rows):
        ids_NS[i, : len(r_ids)] = r_ids
        mask_NS[i, : len(r_mask)] = r_mask
    return ids_NS, mask_NS
