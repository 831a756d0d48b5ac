"""The HTTP server through the official `openai` client and our own clients, on a real port."""

from __future__ import annotations

import time

import pytest

from atelier.inference.client import GenerateClient, OpenAIChatModel, ServerError, connect, parse_tool_calls
from atelier.inference.models import ModelNotFound
from atelier.inference.types import ChatModel, SamplingParams, TokenModel
from tests.inference.conftest import free_port, serving

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(spiky_model_dir, weights_dir):
    """(engine, base_url): uvicorn serving a LocalEngine in a thread for this module, weight updates
    on from `weights_dir`."""
    from atelier.inference.engine import LocalEngine

    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as engine, \
            serving(engine, weights_dir=weights_dir) as url:
        yield engine, url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused")


MESSAGES = [{"role": "user", "content": "Fix the failing test in src/app.py"}]


def _chat_ids(engine) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))


def test_models_and_health(server, oai):
    engine, url = server
    models = oai.models.list().data
    assert [m.id for m in models] == [engine.name]
    assert models[0].model_extra["atelier"]["tokenizer_path"] == str(engine.path)


def test_chat_completion_matches_the_engine(server, oai):
    engine, _ = server
    reply = oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=20, temperature=0,
                                        logprobs=True)
    choice = reply.choices[0]
    direct = engine.generate(_chat_ids(engine), SamplingParams(max_tokens=20, temperature=0))
    ext = choice.model_extra["atelier"]
    assert ext["token_ids"] == direct.token_ids and ext["prompt_token_ids"] == _chat_ids(engine)
    assert choice.message.content == direct.text
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(direct.logprobs, abs=1e-5)
    assert reply.usage.completion_tokens == len(direct.token_ids)
    assert choice.finish_reason in ("stop", "length")


def test_chat_streaming_carries_every_token_once(server, oai):
    engine, _ = server
    stream = oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=24, temperature=0,
                                         stream=True)
    text, ids, versions, finish = "", [], [], None
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        ids += choice.model_extra["atelier"]["token_ids"]
        versions += choice.model_extra["atelier"]["versions"]
        finish = choice.finish_reason or finish
    direct = engine.generate(_chat_ids(engine), SamplingParams(max_tokens=24, temperature=0))
    assert ids == direct.token_ids and text == direct.text and finish == direct.finish_reason
    assert versions == [engine.version] * len(ids)


def test_stop_strings_are_cut_from_text_but_not_from_token_ids(server, oai):
    engine, _ = server
    full = engine.generate(_chat_ids(engine), SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(-1,)))
    stop = full.text[12:15]
    kwargs = dict(model=engine.name, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop])
    reply = oai.chat.completions.create(**kwargs)
    content = reply.choices[0].message.content
    assert stop not in content and full.text.startswith(content) and reply.choices[0].finish_reason == "stop"
    ids = reply.choices[0].model_extra["atelier"]["token_ids"]
    assert stop in engine.tokenizer.decode(ids)  # the tokens that made the stop string are kept
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kwargs, stream=True))
    assert streamed == content


def test_split_tool_calls_takes_well_formed_blocks_only():
    from atelier.inference.server import split_tool_calls

    text = ('Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
            '<tool_call>{"name": "edit_file", "arguments": {"path": </tool_call>')
    rest, calls = split_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["read_file"]
    assert parse_tool_calls(calls)[0]["arguments"] == {"path": "a.py"}
    assert rest.startswith("Reading it.") and '"edit_file"' in rest and "read_file" not in rest
    assert split_tool_calls("no calls here ") == ("no calls here ", [])


def test_visible_text_holds_back_partial_stop_strings():
    from atelier.inference.server import visible_text

    assert visible_text("abc</end>xyz", ("</end>",), True) == "abc"
    assert visible_text("abc</e", ("</end>",), False) == "abc"
    assert visible_text("abc</e", ("</end>",), True) == "abc</e"
    assert visible_text("abc", (), False) == "abc"


def test_completions_text_and_token_prompts(server, oai):
    engine, _ = server
    prompt = "def main():\n"
    ids = engine.tokenizer.encode(prompt)
    direct = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0))
    by_text = oai.completions.create(model=engine.name, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    by_ids = oai.completions.create(model=engine.name, prompt=ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == direct.text == by_ids.choices[0].text
    assert by_text.choices[0].logprobs.token_logprobs == pytest.approx(direct.logprobs, abs=1e-5)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=engine.name, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert streamed == direct.text


def test_generate_client_is_a_token_model_and_sees_weight_updates(server, weights_dir):
    from safetensors.torch import save_file

    engine, url = server
    with GenerateClient(url + "/v1") as client:
        assert isinstance(client, TokenModel) and client.name == engine.name
        assert client.max_seq_len == engine.max_seq_len
        ids = client.tokenizer.encode("import os")
        params = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
        got, direct = client.generate(ids, params), engine.generate(ids, params)
        assert (got.token_ids, got.versions) == (direct.token_ids, direct.versions)
        assert got.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
        key = "model.norm.weight"
        save_file({key: engine.model.state_dict()[key].clone()}, str(weights_dir / "w.safetensors"))
        before = engine.version
        assert client.update_weights_from_path(str(weights_dir / "w.safetensors"), before + 1) == 1
        assert client.version == before + 1
        assert set(client.generate(ids, params).versions) == {before + 1}


def test_server_errors_reach_the_client_as_messages(server):
    _, url = server
    with GenerateClient(url) as client:
        with pytest.raises(ServerError, match="empty prompt"):
            client.generate([], SamplingParams(max_tokens=2))
        with pytest.raises(ServerError, match="no safetensors"):
            client.update_weights_from_path("nonexistent/dir", 99)


def test_openai_chat_model_and_connect(server):
    engine, url = server
    model = connect(url)
    assert isinstance(model, GenerateClient)
    chat = OpenAIChatModel(url, api_key="k")
    assert isinstance(chat, ChatModel) and chat.name == engine.name
    reply = chat.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0))
    direct = engine.generate(_chat_ids(engine), SamplingParams(max_tokens=10, temperature=0))
    assert reply.text == direct.text and reply.completion_tokens == len(direct.token_ids)


def test_unreachable_server_says_how_to_start_one():
    with pytest.raises(ServerError, match="cannot reach") as info:
        OpenAIChatModel(f"http://127.0.0.1:{free_port()}", model="m").chat(MESSAGES)
    assert "atelier serve" in info.value.hint


def test_parse_native_tool_calls():
    raw = [{"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
           {"id": "c2", "type": "function", "function": {"name": "edit_file", "arguments": '{"path": '}}]
    assert parse_tool_calls(raw) == [{"id": "c1", "name": "read_file", "arguments": {"path": "a.py"}},
                                     {"id": "c2", "name": "edit_file", "arguments": '{"path": '}]


def test_open_model_on_a_url_connects(server):
    from atelier.inference.models import open_model

    engine, url = server
    with open_model(url + "/v1") as client:
        assert isinstance(client, GenerateClient) and client.name == engine.name


def test_atelier_serve_with_a_missing_model_prints_the_pull_hint(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from atelier.cli import main as cli

    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli.app, ["serve", "--model", "smollm2-135m"])
    assert isinstance(result.exception, ModelNotFound)
    assert "atelier models pull smollm2-135m" in result.exception.hint


@pytest.mark.slow
def test_atelier_serve_command_serves(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    import httpx

    env = {**os.environ, "ATELIER_CACHE": str(tmp_path / "cache")}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "atelier.cli.main", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
        assert health["status"] == "ok" and health["version"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
