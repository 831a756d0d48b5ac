"""A real model that replays canned outputs, for tests and demos.

`ScriptedModel` is a `TokenModel`: each `generate` call tokenizes the next
scripted assistant text with a real Hugging Face tokenizer, appends the
end-of-turn token, and returns the ids with logprob 0.0 (the script is
certain) and the configured policy version on every token. It honours
`max_tokens` (cut with finish_reason "length") and the prompt it was given
is kept in `prompts`, so tests can check what the harness sent.
`ScriptedChatModel` does the same for the chat protocol, including native
tool calls.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Sequence

from atelier.errors import AtelierError
from atelier.inference.types import ChatReply, Generation, SamplingParams


class ScriptExhausted(AtelierError):
    """The scripted model was asked for more turns than its script has."""


def load_script(path: str | Path) -> list[str]:
    """A JSON list of assistant texts."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AtelierError(f"script file not found: {path}", hint="give a JSON list of assistant texts") from None
    except json.JSONDecodeError as exc:
        raise AtelierError(f"script {path} is not valid JSON: {exc}",
                           hint='write a JSON list of strings, e.g. ["<tool_call>...</tool_call>"]') from None
    if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
        raise AtelierError(f"script {path} must be a JSON list of strings (one per assistant turn)")
    return data


class ScriptedModel:
    """Replays `texts` in order, one per `generate` call; thread-safe."""

    def __init__(self, tokenizer: Any, texts: Sequence[str], *, name: str = "scripted", version: int = 0,
                 append_eos: bool = True, record_prompts: bool = True) -> None:
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        self.name = name
        self.version = version
        self.append_eos = append_eos
        self.record_prompts = record_prompts   # off for long benchmark runs: prompts grow with every turn
        self.texts = list(texts)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self._lock = threading.Lock()

    @property
    def remaining(self) -> int:
        return len(self.texts) - len(self.outputs)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        with self._lock:
            i = len(self.outputs)
            if i >= len(self.texts):
                raise ScriptExhausted(f"the script has {len(self.texts)} turns and turn {i + 1} was asked for",
                                      hint="add turns to the script (end it with a submit call)")
            ids = self.tokenizer.encode(self.texts[i], add_special_tokens=False)
            eos = self.tokenizer.eos_token_id
            if self.append_eos and eos is not None:
                ids.append(eos)
            finish = "stop"
            if len(ids) > params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            if self.record_prompts:
                self.prompts.append(list(prompt_ids))
            self.outputs.append(ids)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), versions=[self.version] * len(ids),
                          finish_reason=finish, text=self.tokenizer.decode(ids))


class ScriptedChatModel:
    """Replays `ChatReply`s (or plain texts) in order through the chat protocol."""

    def __init__(self, replies: Sequence[ChatReply | str], *, name: str = "scripted-chat") -> None:
        self.name = name
        self.replies = [r if isinstance(r, ChatReply) else ChatReply(text=r) for r in replies]
        self.requests: list[list[dict[str, Any]]] = []
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> ChatReply:
        with self._lock:
            if len(self.requests) >= len(self.replies):
                raise ScriptExhausted(f"the script has {len(self.replies)} replies and more were asked for")
            self.requests.append([dict(m) for m in messages])
            return self.replies[len(self.requests) - 1]
