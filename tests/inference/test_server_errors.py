"""`atelier serve` under bad input, a full queue, disconnecting clients and concurrent long prompts."""

from __future__ import annotations

import threading

import httpx
import pytest

from atelier.inference.types import SamplingParams
from tests.helpers import wait_until
from tests.inference.conftest import serving

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Fix the failing test in src/app.py"}]


@pytest.fixture(scope="module")
def served(spiky_model_dir):
    """(engine, url) with a queue limit of 2 and 4 batch slots."""
    from atelier.inference.engine import LocalEngine

    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=4, max_queue=2,
                     kv_cache_tokens=4096) as engine, serving(engine) as url:
        yield engine, url


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def _post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(url + path, timeout=60, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "type" in error
    return error


def test_malformed_json_and_non_object_bodies_are_400(served):
    _, url = served
    error = _error(_post(url, "/v1/chat/completions", content=b'{"messages": [', headers={
        "content-type": "application/json"}), 400)
    assert "malformed JSON" in error["message"]
    error = _error(_post(url, "/v1/chat/completions", json=[1, 2]), 400)
    assert "JSON object" in error["message"]
    error = _error(_post(url, "/v1/chat/completions", json={"messages": "hi"}), 400)
    assert error["param"] == "messages"


def test_unknown_model_is_404(served, oai):
    engine, url = served
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-7", messages=MESSAGES, max_tokens=4)
    assert "gpt-7" in str(info.value) and engine.name in str(info.value)
    assert _error(_post(url, "/v1/completions", json={"model": "nope", "prompt": "x"}), 404)["code"] == \
        "model_not_found"
    # The served name, its directory and no name at all are accepted.
    for model in (engine.name, str(engine.path)):
        assert oai.completions.create(model=model, prompt="x", max_tokens=2).choices[0].finish_reason
    assert _post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("max_tokens,words", [(-5, "at least 1"), (0, "at least 1"), (10**7, "exceeds the context")])
def test_negative_zero_and_oversize_max_tokens_are_400(served, oai, max_tokens, words):
    engine, _ = served
    with pytest.raises(openai.BadRequestError, match=words):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=max_tokens)
    with pytest.raises(openai.BadRequestError, match=words):
        oai.completions.create(model=engine.name, prompt="x", max_tokens=max_tokens)


def test_empty_messages_bad_sampling_and_long_prompts_are_400(served, oai):
    engine, url = served
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        oai.chat.completions.create(model=engine.name, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=4, top_p=0)
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 128"):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=4, n=129)
    with pytest.raises(openai.BadRequestError, match="asks for 3 choices.*queues at most 2"):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=4, n=3)
    with pytest.raises(openai.BadRequestError, match="does not fit the context"):
        oai.completions.create(model=engine.name, prompt=[5] * (engine.max_seq_len + 10), max_tokens=4)
    assert "role" in _error(_post(url, "/v1/chat/completions", json={"messages": [{"content": "x"}]}), 400)[
        "message"]
    assert "empty prompt" in _error(_post(url, "/v1/generate", json={"prompt_ids": []}), 400)["message"]


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"),
                                         ("top_p", "NaN"), ("seed", str(2**64)), ("stop", '[""]')])
def test_values_the_sampler_cannot_use_are_400_not_a_failed_batch(served, field, value):
    """Python's JSON parser takes NaN and Infinity; a NaN temperature that reached the engine would
    fail every request batched with it, and a seed torch cannot take would be a 500."""
    engine, url = served
    body = f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'.encode()
    error = _error(_post(url, "/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == field
    assert _post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": 2**63}).status_code == 200


def _hold_scheduler(engine):
    """Block the engine's scheduler inside a token callback; returns (release, handle)."""
    started, release = threading.Event(), threading.Event()

    def hold(*_: object) -> None:
        started.set()
        release.wait(60)

    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), on_token=hold)
    assert started.wait(60)
    return release, handle


def test_a_full_queue_answers_503_with_retry_after(served):
    engine, url = served
    release, held = _hold_scheduler(engine)
    try:
        queued = [engine.submit([4, 5, 6], SamplingParams(max_tokens=2)) for _ in range(2)]
        response = _post(url, "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
        error = _error(response, 503)
        assert int(response.headers["retry-after"]) >= 1 and error["code"] == "queue_full"
        stream = _post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert stream.status_code == 503  # refused before the stream starts
    finally:
        release.set()
    assert held.result(timeout=60).token_ids and all(q.result(timeout=60).token_ids for q in queued)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(served, stream):
    engine, url = served
    cancelled = engine.stats["cancelled"]
    release, held = _hold_scheduler(engine)
    body = {"prompt": "def main():\n" * 30, "max_tokens": 3000, "temperature": 0, "stream": stream}
    try:
        with httpx.Client(timeout=60) as client:
            if stream:
                with client.stream("POST", url + "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    next(response.iter_lines())  # the first event, then hang up
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        # The server noticed and flagged the request before the engine ran one more step.
        assert wait_until(lambda: any(r.cancelled for r in engine._waiting + engine._active))
    finally:
        release.set()
    held.result(timeout=60)
    assert wait_until(lambda: engine.stats["cancelled"] == cancelled + 1 and engine.pool.used == 0)
    assert engine.stats["steps"] < 2000  # it never ran to its 3000 tokens


def test_concurrent_clients_with_long_prompts_match_the_engine(served, oai):
    engine, _ = served
    code = "def handler(event, context):\n    return {'status': 200, 'body': event}\n"
    prompts = [[{"role": "user", "content": code * (1 + 12 * (i % 3)) + f"task {i}"}] for i in range(10)]
    results: list = [None] * len(prompts)
    # rides out 503s, however long the engine is busy (building a kernel for a new shape takes seconds)
    client = openai.OpenAI(base_url=oai.base_url, api_key="unused", max_retries=40)

    def worker(i: int) -> None:
        results[i] = client.chat.completions.create(model=engine.name, messages=prompts[i], max_tokens=12,
                                                    temperature=0, stream=i % 2 == 1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, got in enumerate(results):
        assert got is not None, f"client {i} got no answer (its retries ran out, or it raised)"
        ids = engine.tokenizer.apply_chat_template(prompts[i], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        direct = engine.generate(list(ids), SamplingParams(max_tokens=12, temperature=0))
        if i % 2:
            text = "".join(c.choices[0].delta.content or "" for c in got)
        else:
            text = got.choices[0].message.content
        assert text == direct.text
    assert max(len(engine.tokenizer.encode(p[0]["content"])) for p in prompts) > 700
    assert engine.pool.used == 0


def test_tools_are_accepted_by_the_openai_client(served, oai):
    engine, _ = served
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": {"type": "object",
                                                               "properties": {"path": {"type": "string"}}}}}]
    reply = oai.chat.completions.create(model=engine.name, messages=MESSAGES, tools=tools, max_tokens=8,
                                        temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
