"""`atelier serve` as the agents' clients see it: the `openai` client and litellm (what
litellm-based agents such as mini-swe-agent call), non-streamed and streamed, with native tool calls.

A random model never writes a tool call, so the tool-call checks serve a scripted engine: a fake
with the server's engine interface that replays canned replies (real tokenizer, real token ids).
The plain-text checks also run against the real engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from atelier.inference.scripted import ScriptedModel
from atelier.inference.types import Generation, SamplingParams
from tests.inference.conftest import serving

openai = pytest.importorskip("openai")
# litellm's own types trip pydantic's warnings at import; they are not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")

MESSAGES = [{"role": "user", "content": "Fix the failing test in src/app.py"}]
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'


class _Finished:
    def __init__(self, gen: Generation) -> None:
        self.gen, self.done = gen, True

    def result(self, timeout: float | None = None) -> Generation:
        return self.gen

    def cancel(self) -> None:
        pass


class ScriptedServedEngine:
    """What `create_app` needs of an engine, replaying `texts` one per request."""

    def __init__(self, model_dir: Path, texts: list[str]) -> None:
        self.script = ScriptedModel(model_dir, texts, name="scripted")
        self.tokenizer, self.path, self.name = self.script.tokenizer, Path(model_dir), "scripted"
        self.version, self.max_seq_len, self.waiting, self.max_queue = 0, 2048, 0, None
        self.pool = SimpleNamespace(used=0, num_blocks=1)

    def check_request(self, prompt_tokens: int, max_tokens: int, *, strict: bool = False,
                      scoring: bool = False) -> None:
        assert prompt_tokens >= 1 and 1 <= max_tokens <= self.max_seq_len

    def update_weights(self, state_dict, version: int) -> None:
        raise NotImplementedError("a script has no weights")

    def submit(self, prompt, params: SamplingParams, on_token=None, on_done=None) -> _Finished:
        gen = self.script.generate(prompt, params)
        gen.text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)  # as LocalEngine's
        for token, logprob, version in zip(gen.token_ids, gen.logprobs, gen.versions):
            if on_token:
                on_token(token, logprob, version)
        if on_done:
            on_done()
        return _Finished(gen)


@pytest.fixture()
def scripted(spiky_model_dir):
    """(engine, base_url) for a script of: a tool call, a broken one, a plain reply, repeated."""
    engine = ScriptedServedEngine(spiky_model_dir, [CALL, BROKEN, "All tests pass now."] * 2)
    with serving(engine) as url:
        yield engine, url


def _via_openai(url: str, **kwargs):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=64, **kwargs)


def _via_litellm(litellm, url: str, **kwargs):
    return litellm.completion(model="openai/scripted", api_base=url + "/v1", api_key="unused", messages=MESSAGES,
                              max_tokens=64, **kwargs)


@pytest.mark.parametrize("client", ["openai", "litellm"])
def test_native_tool_calls_reach_the_client(scripted, client, request):
    engine, url = scripted
    if client == "openai":
        ask = lambda **kw: _via_openai(url, **kw)  # noqa: E731
    else:
        litellm = request.getfixturevalue("litellm")
        ask = lambda **kw: _via_litellm(litellm, url, **kw)  # noqa: E731
    choice = ask(tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "src/app.py"}
    assert call.id and not choice.message.content
    # A malformed block stays in the text, for the agent's own parser to count as a broken call.
    choice = ask(tools=TOOLS).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == BROKEN
    # Streamed: the text as generated, every piece once.
    chunks = list(ask(tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "All tests pass now."
    assert engine.script.outputs[0] == engine.tokenizer.encode(CALL, add_special_tokens=False) + [
        engine.tokenizer.eos_token_id]


def test_litellm_gets_the_engines_own_text_streamed_and_not(engine, litellm):
    with serving(engine) as url:
        ids = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        direct = engine.generate(list(ids), SamplingParams(max_tokens=16, temperature=0))
        reply = litellm.completion(model=f"openai/{engine.name}", api_base=url + "/v1", api_key="unused",
                                   messages=MESSAGES, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == direct.text
        assert reply.usage.completion_tokens == len(direct.token_ids)
        stream = litellm.completion(model=f"openai/{engine.name}", api_base=url + "/v1", api_key="unused",
                                    messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == direct.text
