"""vLLM's OpenAI server as the oracle of the dialect: the same requests to `atelier serve` and to a
real vLLM (its CPU build, fp32) on the same tiny model give replies of the same shape, the same
tokens, and logprobs that agree. The vLLM server is the session fixture `vllm_engine`
(tests/conftest.py), skipped, saying why, where its environment is absent."""

from __future__ import annotations

import httpx
import pytest

from tests.inference.conftest import serving

pytestmark = pytest.mark.timeout(1800)  # the first test to use the session's vLLM waits for its start


@pytest.fixture(scope="module")
def both(vllm_engine, vllm_model_dir):
    """(our base URL, vLLM's base URL, the name vLLM serves the model by)."""
    from atelier.inference.engine import LocalEngine

    with LocalEngine(vllm_model_dir, dtype="float32", max_batch=8) as engine, serving(engine) as url:
        yield url, vllm_engine.base_url, vllm_engine.served_name


def _post(base: str, path: str, body: dict) -> dict:
    response = httpx.post(base + path, json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _shape(value):
    """The keys and types of a JSON value, lists by their first element."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def _piece(text: str) -> str | None:
    """A token's text, None for one that ends inside a UTF-8 character: its text alone is U+FFFD
    here (as vLLM gives a prompt token), while vLLM gives a sampled one "" or the character the
    preceding sampled tokens complete."""
    return None if not text or text.endswith("\ufffd") else text


def _whole(top: dict[str, float]) -> dict[str, float]:
    """A top-logprobs entry without the tokens that end inside a UTF-8 character (`_piece`)."""
    return {k: v for k, v in top.items() if _piece(k) is not None}


@pytest.mark.parametrize("echo,max_tokens", [(True, 1), (True, 0), (False, 4)])
def test_completions_logprobs_match_vllms(both, echo, max_tokens):
    ours, theirs, name = both
    body = {"prompt": "def main():\n    return parse(", "logprobs": 3, "echo": echo, "max_tokens": max_tokens,
            "temperature": 0}
    a = _post(ours, "/v1/completions", body)["choices"][0]
    b = _post(theirs, "/v1/completions", {**body, "model": name})["choices"][0]
    assert a["text"] == b["text"]
    la, lb = a["logprobs"], b["logprobs"]
    assert set(la) == set(lb) >= {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert [_piece(t) for t in la["tokens"]] == [_piece(t) for t in lb["tokens"]]
    whole = next((i for i, t in enumerate(la["tokens"]) if _piece(t) is None), len(la["tokens"]))
    assert la["text_offset"][:whole + 1] == lb["text_offset"][:whole + 1]
    assert [x is None for x in la["token_logprobs"]] == [x is None for x in lb["token_logprobs"]]
    assert [x for x in la["token_logprobs"] if x is not None] == pytest.approx(
        [x for x in lb["token_logprobs"] if x is not None], abs=1e-3)
    for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"]):
        assert (ta is None) == (tb is None)
        if ta is not None:
            assert _whole(ta) == pytest.approx(_whole(tb), abs=1e-3)


def test_chat_top_logprobs_n_and_usage_match_vllms(both):
    ours, theirs, name = both
    body = {"messages": [{"role": "user", "content": "Fix the failing test"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    a = _post(ours, "/v1/chat/completions", body)
    b = _post(theirs, "/v1/chat/completions", {**body, "model": name})
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: a["usage"][k] for k in counts} == {k: b["usage"][k] for k in counts}
    ca, cb = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
    assert _shape(ca) == _shape(cb)
    assert [_piece(t["token"]) for t in ca] == [_piece(t["token"]) for t in cb]
    assert [t["logprob"] for t in ca] == pytest.approx([t["logprob"] for t in cb], abs=1e-3)
    assert [t["logprob"] for x in ca for t in x["top_logprobs"]] == pytest.approx(
        [t["logprob"] for x in cb for t in x["top_logprobs"]], abs=1e-3)
    # n > 1 (vLLM refuses it with greedy sampling; this server gives n equal choices there).
    sampled = {**body, "temperature": 0.8, "seed": 3, "n": 3}
    a = _post(ours, "/v1/chat/completions", sampled)
    b = _post(theirs, "/v1/chat/completions", {**sampled, "model": name})
    assert [c["index"] for c in a["choices"]] == [c["index"] for c in b["choices"]] == [0, 1, 2]
    assert set(a["choices"][0]) - {"atelier"} <= set(b["choices"][0])
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
