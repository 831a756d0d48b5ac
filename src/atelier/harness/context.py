"""The model's context window, kept token-exact for token models.

`TokenContext` (any `TokenModel`) keeps the current `Segment`:

- `start(messages)` renders the segment's prompt with the tokenizer's chat
  template and tokenizes it once;
- `sample()` appends the sampled ids verbatim (`Segment.extend_sampled`),
  with their logprobs and per-token versions;
- `observe()`/`ask()` append only the *delta* of the new messages: the text
  difference render(messages + new, generation prompt) minus
  render(messages), tokenized alone, preceded by whatever the template puts
  after an assistant message that the model did not sample itself (the
  newline after the end-of-turn token, or the end-of-turn token when a turn
  was cut at its length limit).

Earlier tokens are never re-tokenized (docs/pitfalls.md: re-applying a
template to history changed the tokens that were trained on). `ChatContext` (any
`ChatModel`) keeps messages only: no segments, no logprobs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from atelier.harness.config import AgentConfig
from atelier.harness.errors import FormatError
from atelier.harness.parsing import Item, ParsedTurn, ToolCall, parse_native_calls, parse_tool_calls
from atelier.harness.prompt import tool_response
from atelier.harness.trajectory import Segment, Trajectory
from atelier.inference.types import SamplingParams, TokenModel

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass
class Turn:
    text: str                # the assistant message content (end-of-turn token removed)
    parsed: ParsedTurn
    sampled: int             # tokens sampled this turn
    finish_reason: str


@dataclass
class Result:
    item: Item               # the call (or the format error) this answers
    output: str
    ok: bool


class ContextWindow(Protocol):
    """What the agent loop needs of a context window (`TokenContext`, `ChatContext`)."""

    turns_in_segment: int

    @property
    def size(self) -> int:
        """Tokens in the current segment (a chat backend's usage count, or an estimate)."""
        ...

    def count(self, text: str) -> int: ...

    def start(self, messages: list[dict[str, Any]]) -> None:
        """Begin a segment with these messages (the first, or after a summary)."""
        ...

    def sample(self, max_new: int, seed: int | None) -> Turn: ...

    def add_messages(self, new: list[dict[str, Any]]) -> int:
        """Append messages the model did not sample; returns their token count."""
        ...

    def observe(self, results: list[Result]) -> int:
        """Show a turn's tool results; returns their token count."""
        ...


def open_window(model: Any, config: AgentConfig, traj: Trajectory,
                tools: list[dict[str, Any]] | None) -> ContextWindow:
    """A `TokenContext` for a `TokenModel` (token-exact), else a `ChatContext`
    (`tools`: the OpenAI schemas, passed only with native tool calls)."""
    if isinstance(model, TokenModel):
        return TokenContext(model, config, traj)
    return ChatContext(model, config, traj, tools)


def _name(item: Item) -> str:
    return item.name if isinstance(item, ToolCall) else "invalid_call"


def observation_messages(results: list[Result], role: str) -> list[dict[str, Any]]:
    if role == "user":
        body = "\n".join(tool_response(_name(r.item), r.output, r.ok) for r in results)
        return [{"role": "user", "content": body}]
    out = []
    for r in results:
        msg = {"role": "tool", "name": _name(r.item), "content": r.output}
        if isinstance(r.item, ToolCall) and r.item.id:
            msg["tool_call_id"] = r.item.id
        out.append(msg)
    return out


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's eos and the end-of-turn tokens its vocabulary has."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in END_OF_TURN if t in vocab and t != "<|endoftext|>"}
    return tuple(sorted(i for i in ids if i is not None))


class TokenContext:
    """The current segment of a token model's episode.

    Rendering the whole history with the chat template each turn costs time
    linear in the history. Templates that render each message on its own
    (ChatML, Llama 3, most others) give the same delta when rendered over
    just the system message and the last message; the first `PROBES` deltas
    of an episode are computed both ways, and only if they agree does the
    rest of the episode use the short form. A template that looks further
    back keeps full renders throughout.
    """

    PROBES = 3

    def __init__(self, model: Any, config: AgentConfig, traj: Trajectory) -> None:
        self.model, self.config, self.traj = model, config, traj
        self.tok = model.tokenizer
        self.stop = stop_ids(self.tok)
        self.messages: list[dict[str, Any]] = []
        self.segment = Segment()
        self.glue = ""          # template text after the last assistant message that was not sampled
        self.turns_in_segment = 0
        self.local: bool | None = None   # None: still probing whether the template renders locally
        self.probes = 0

    def render(self, messages: list[dict[str, Any]], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    @property
    def size(self) -> int:
        return len(self.segment)

    def _derive(self, extra: list[dict[str, Any]], gen_before: bool, gen_after: bool,
                derive: Callable[[str, str], str]) -> str:
        """derive(render(messages, gen_before), render(messages + extra, gen_after)),
        over the full history or, once proven equivalent, the short one."""
        def over(history: list[dict[str, Any]]) -> str:
            return derive(self.render(history, gen_before), self.render([*history, *extra], gen_after))

        short = self.messages[:1] + self.messages[-1:] if len(self.messages) > 2 else None
        if short is None:
            return over(self.messages)
        if self.local:
            return over(short)
        full = over(self.messages)
        if self.local is None:
            self.probes += 1
            if over(short) != full:
                self.local = False
            elif self.probes >= self.PROBES:
                self.local = True
        return full

    def start(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)
        ids = self.encode(self.render(self.messages, True))
        self.segment = Segment()
        self.segment.extend_prompt(ids)
        self.turns_in_segment = 0
        self.traj.segments.append(self.segment)
        self.traj.messages.extend(messages)
        self.traj.add_tokens("prompt", len(ids))

    def sample(self, max_new: int, seed: int | None) -> Turn:
        s = self.config.sampling
        params = SamplingParams(max_tokens=max_new, temperature=s.temperature, top_p=s.top_p, seed=seed,
                                stop_token_ids=self.stop)
        context = list(self.segment.token_ids)
        started, clock = time.time(), time.perf_counter()
        gen = self.model.generate(context, params)
        self.traj.record_generate(started, time.perf_counter() - clock, len(context), len(gen.token_ids))
        self.segment.extend_sampled(gen.token_ids, gen.logprobs, gen.versions, gen.routes)
        ended = bool(gen.token_ids) and gen.token_ids[-1] in self.stop
        content = self.tok.decode(gen.token_ids[:-1] if ended else gen.token_ids, skip_special_tokens=False)
        assistant = {"role": "assistant", "content": content}
        fallback = self.tok.decode(self.stop[:1]) + "\n"

        def tail(before: str, after: str) -> str:
            """What the template writes after the assistant's content."""
            if after.startswith(before + content):
                return after[len(before) + len(content):]
            at = after.rfind(content) if content else -1  # the template rewrote the message
            return after[at + len(content):] if at >= 0 else fallback

        rest = self._derive([assistant], True, False, tail)
        eos_text = self.tok.decode(gen.token_ids[-1:], skip_special_tokens=False) if ended else ""
        self.glue = rest[len(eos_text):] if eos_text and rest.startswith(eos_text) else rest
        self.messages.append(assistant)
        self.traj.messages.append(assistant)
        self.traj.add_tokens("completion", len(gen.token_ids))
        self.turns_in_segment += 1
        return Turn(content, parse_tool_calls(content), len(gen.token_ids), gen.finish_reason)

    def add_messages(self, new: list[dict[str, Any]]) -> int:
        def delta(before: str, after: str) -> str:
            if after.startswith(before):
                return after[len(before):]
            # A template that renders history differently once more follows: keep what we have.
            return after[len(os.path.commonprefix([after, before])):]

        ids = self.encode(self.glue + self._derive(new, False, True, delta))
        self.segment.extend_prompt(ids)
        self.glue = ""
        self.messages.extend(new)
        self.traj.messages.extend(new)
        return len(ids)

    def observe(self, results: list[Result]) -> int:
        n = self.add_messages(observation_messages(results, self.config.observation_role))
        self.traj.add_tokens("tool_output", n)
        return n


class ChatContext:
    """Messages only, for chat backends; sizes come from the backend's usage counts."""

    def __init__(self, model: Any, config: AgentConfig, traj: Trajectory, tools: list[dict] | None) -> None:
        self.model, self.config, self.traj, self.tools = model, config, traj, tools
        self.messages: list[dict[str, Any]] = []
        self.size = 0
        self.turns_in_segment = 0

    def count(self, text: str) -> int:
        return (len(text) + 3) // 4  # no tokenizer: the usual 4 characters per token

    def start(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)
        self.turns_in_segment = 0
        self.size = sum(self.count(m["content"]) for m in messages)
        self.traj.messages.extend(messages)

    def sample(self, max_new: int, seed: int | None) -> Turn:
        s = self.config.sampling
        params = SamplingParams(max_tokens=max_new, temperature=s.temperature, top_p=s.top_p, seed=seed)
        reply = self.model.chat(list(self.messages), params, self.tools)
        parsed = parse_native_calls(reply.tool_calls, reply.text) if reply.tool_calls else parse_tool_calls(reply.text)
        assistant: dict[str, Any] = {"role": "assistant", "content": reply.text}
        native = [c for c in parsed.calls if c.id]
        if native:
            assistant["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for c in native]
        self.messages.append(assistant)
        self.traj.messages.append(assistant)
        sampled = reply.completion_tokens or self.count(reply.text)
        self.size = (reply.prompt_tokens or self.size) + sampled
        self.turns_in_segment += 1
        self.traj.add_tokens("prompt", reply.prompt_tokens)
        self.traj.add_tokens("completion", sampled)
        return Turn(reply.text, parsed, sampled, reply.finish_reason)

    def add_messages(self, new: list[dict[str, Any]]) -> int:
        self.messages.extend(new)
        self.traj.messages.extend(new)
        n = sum(self.count(m["content"]) for m in new)
        self.size += n
        return n

    def observe(self, results: list[Result]) -> int:
        native = any(isinstance(r.item, ToolCall) and r.item.id for r in results)
        role = "tool" if native else self.config.observation_role
        n = self.add_messages(observation_messages(results, role))
        self.traj.add_tokens("tool_output", n)
        return n


__all__ = ["ContextWindow", "TokenContext", "ChatContext", "open_window", "Turn", "Result", "FormatError",
           "observation_messages"]
