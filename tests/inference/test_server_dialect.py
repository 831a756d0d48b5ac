"""The OpenAI dialect evaluation tools speak, through the `openai` client and litellm on a real port:
echo and prompt logprobs, top logprobs, n, lists of prompts, usage, and a 400 naming every field
the server would otherwise have to drop."""

from __future__ import annotations

import httpx
import pytest

from atelier.inference.openai_requests import MAX_LOGPROBS
from atelier.inference.types import SamplingParams
from tests.inference.conftest import serving

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")

MESSAGES = [{"role": "user", "content": "Fix the failing test in src/app.py"}]
PROMPT = "def main():\n    return parse(sys.argv)\n"


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as url:
        yield engine, url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def _reference_logprobs(hf_model, ids: list[int]):
    """transformers' log-softmax over the prompt: row i is the distribution of token i + 1."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _legacy_top(tokenizer, logprobs_V, k: int, token: int) -> dict[str, float]:
    """The legacy `top_logprobs` entry of one position: the k most likely and the token itself, by
    text (where two tokens' texts are the same, the likelier one's logprob)."""
    values, best = logprobs_V.topk(k)
    expected: dict[str, float] = {}
    for t, v in [*zip(best.tolist(), values.tolist()), (token, logprobs_V[token].item())]:
        expected.setdefault(tokenizer.decode([t]), v)
    return expected


def test_echo_scores_the_prompt_as_transformers_does(server, oai, hf_model):
    engine, _ = server
    ids = engine.tokenizer.encode(PROMPT)
    reply = oai.completions.create(model=engine.name, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0,
                                   temperature=0)
    [choice] = reply.choices
    lp = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    ref = _reference_logprobs(hf_model, ids)
    assert lp.token_logprobs[1:] == pytest.approx([ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
                                                  abs=1e-4)
    for i in range(1, len(ids)):
        expected = _legacy_top(engine.tokenizer, ref[i - 1], 3, ids[i])
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=1e-4)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_echo_with_one_generated_token_is_what_lm_eval_reads(server, oai):
    """lm-evaluation-harness asks for max_tokens 1, echo and logprobs 1, and drops the last entry."""
    engine, _ = server
    ids = engine.tokenizer.encode(PROMPT)
    lp = oai.completions.create(model=engine.name, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                temperature=0).choices[0].logprobs
    scored = oai.completions.create(model=engine.name, prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                    temperature=0).choices[0].logprobs
    direct = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[:-1] == pytest.approx(scored.token_logprobs, abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(direct.logprobs[0], abs=1e-5)
    # Greedy: the generated token is its position's most likely one.
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(lp.token_logprobs[-1])


def test_echo_without_logprobs_and_generated_top_logprobs(server, oai, hf_model):
    engine, _ = server
    ids = engine.tokenizer.encode(PROMPT)
    direct = engine.generate(ids, SamplingParams(max_tokens=6, temperature=0))
    echoed = oai.completions.create(model=engine.name, prompt=PROMPT, echo=True, max_tokens=6, temperature=0)
    assert echoed.choices[0].text == PROMPT + direct.text and echoed.choices[0].logprobs is None
    lp = oai.completions.create(model=engine.name, prompt=PROMPT, logprobs=4, max_tokens=6,
                                temperature=0).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(direct.logprobs, abs=1e-5) and lp.text_offset[0] == 0
    ref = _reference_logprobs(hf_model, ids + direct.token_ids)
    for k, top in enumerate(lp.top_logprobs):
        expected = _legacy_top(engine.tokenizer, ref[len(ids) - 1 + k], 4, direct.token_ids[k])
        assert top == pytest.approx(expected, abs=1e-4)


def test_a_list_of_prompts_times_n_numbers_choices_as_openai(server, oai):
    engine, _ = server
    prompts = ["import os\n", "class Parser:\n", "x = [1, 2"]
    reply = oai.completions.create(model=engine.name, prompt=prompts, n=2, max_tokens=5, temperature=0.9, seed=11)
    assert [c.index for c in reply.choices] == list(range(6))
    for c in reply.choices:
        i, j = divmod(c.index, 2)
        alone = oai.completions.create(model=engine.name, prompt=prompts[i], max_tokens=5, temperature=0.9,
                                       seed=11 + j)
        assert c.text == alone.choices[0].text  # choice j samples with seed + j
    again = oai.completions.create(model=engine.name, prompt=prompts, n=2, max_tokens=5, temperature=0.9, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    assert reply.usage.completion_tokens == sum(len(c.model_extra["atelier"]["token_ids"]) for c in reply.choices)
    by_ids = oai.completions.create(model=engine.name, prompt=ids, max_tokens=5, temperature=0)
    by_text = oai.completions.create(model=engine.name, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]


def test_chat_n_top_logprobs_and_usage(server, oai, litellm):
    engine, url = server
    prompt = list(engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    direct = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    reply = oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=8, temperature=0, n=3,
                                        logprobs=True, top_logprobs=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.message.content == direct.text
        content = choice.logprobs.content
        assert [c.logprob for c in content] == pytest.approx(direct.logprobs, abs=1e-5)
        for c in content:
            tops = [t.logprob for t in c.top_logprobs]
            assert len(tops) == 5 and tops == sorted(tops, reverse=True) and tops[0] == pytest.approx(c.logprob)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 3 * len(direct.token_ids)
    via = litellm.completion(model=f"openai/{engine.name}", api_base=url + "/v1", api_key="unused",
                             messages=MESSAGES, max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in via.choices] == [direct.text] * 2


def test_streamed_choices_of_several_prompts_and_usage(server):
    engine, url = server
    prompts = ["import os\n", "def f(x):\n"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "echo": True}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    texts, usage = {}, None
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = httpx.Response(200, content=line[6:]).json()
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            usage = event["usage"] or usage
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert usage == plain["usage"]


def test_a_temperature_or_top_p_below_what_floats_hold_is_greedy(server):
    """A temperature below 1e-5 is greedy (the logits would overflow); a top_p too small for fp32
    keeps the most likely token, as any top_p below its probability does."""
    engine, url = server
    body = {"prompt": "x = ", "max_tokens": 6}
    greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60).json()
    for extreme in ({"temperature": 5.3e-69}, {"top_p": 1e-300}, {"top_p": 1e-46, "temperature": 0.7}):
        reply = httpx.post(url + "/v1/completions", json={**body, **extreme}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    flat = httpx.post(url + "/v1/completions", json={**body, "temperature": 1e308, "top_p": 1e-300}, timeout=60)
    assert flat.status_code == 200  # every token equally likely: which one is kept is arbitrary


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(server):
    engine, url = server
    ids = [7] * (engine.max_seq_len - 5)
    reply = httpx.post(url + "/v1/generate", json={"prompt_ids": ids, "temperature": 0, "stop_token_ids": [-1]},
                       timeout=120)
    assert reply.status_code == 200 and len(reply.json()["token_ids"]) == 5
    refused = httpx.post(url + "/v1/generate", json={"prompt_ids": ids, "max_tokens": engine.max_seq_len + 1},
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


ACCEPTED_DEFAULTS = {"user": "eval-run-3", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                     "seed": 4, "top_p": 1, "stop": None}


def test_fields_clients_send_at_their_defaults_are_accepted(server, oai):
    engine, _ = server
    chat = oai.chat.completions.create(
        model=engine.name, messages=MESSAGES, max_completion_tokens=4, response_format={"type": "text"},
        parallel_tool_calls=True, tool_choice="auto", store=False, metadata={"run": "3"}, **ACCEPTED_DEFAULTS,
        extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1, "skip_special_tokens": True},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
    assert chat.usage.completion_tokens <= 4
    text = oai.completions.create(model=engine.name, prompt="x", max_tokens=3, best_of=1, suffix=None,
                                  **ACCEPTED_DEFAULTS, extra_body={"top_k": 0, "ignore_eos": False})
    assert text.usage.completion_tokens <= 3


REFUSED = [
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"logit_bias": {"42": 100}}, "logit_bias"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "}\n"}, "suffix"),
    ("completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": 1, "stream": True}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"top_k": 40}, "top_k"),
    ("completions", {"frobnicate": True}, "frobnicate"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("chat", {"top_logprobs": MAX_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("chat", {"frequency_penalty": -1}, "frequency_penalty"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
]


@pytest.mark.parametrize("endpoint,fields,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_what_the_server_cannot_honour_is_a_400_naming_it(server, endpoint, fields, param):
    _, url = server
    body = {"prompt": "x", "max_tokens": 2} if endpoint == "completions" else {"messages": MESSAGES, "max_tokens": 2}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = httpx.post(url + path, json={**body, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["hint"], error
    assert param.split(".")[0] in error["message"] or "content part" in error["message"]


def test_the_openai_client_sees_a_refused_field_as_its_bad_request(server, oai):
    engine, _ = server
    with pytest.raises(openai.BadRequestError, match="presence_penalty=1.5 is not supported"):
        oai.chat.completions.create(model=engine.name, messages=MESSAGES, max_tokens=2, presence_penalty=1.5)
    with pytest.raises(openai.BadRequestError, match="unsupported field 'guided_json'"):
        oai.completions.create(model=engine.name, prompt="x", max_tokens=2, extra_body={"guided_json": {}})
