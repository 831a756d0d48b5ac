"""No request makes `atelier serve` answer 5xx: schemathesis draws bodies from the server's own
OpenAPI schema (valid ones and, in its negative mode, ones that break it: wrong types, missing and
unknown fields, extreme numbers) for every operation, sends each to a real server on a real port,
and requires a 4xx in OpenAI's error shape or a success; afterwards the server still answers.

The engine's context is short and its queue small, so that the requests the schema allows (up to
128 choices of a whole context each) stay quick on a CPU; what they exercise is the same."""

from __future__ import annotations

import httpx
import pytest

from atelier.inference.types import SamplingParams
from tests.inference.conftest import serving

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def fuzzed(spiky_model_dir, tmp_path_factory):
    """(engine, base URL, schema): weight updates on over an empty directory, so their path checks
    are fuzzed too."""
    from atelier.inference.engine import LocalEngine

    weights = tmp_path_factory.mktemp("fuzz-weights")
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8, max_queue=8, max_seq_len=96,
                     kv_cache_tokens=2048) as engine, serving(engine, weights_dir=weights) as url:
        yield engine, url, schemathesis.openapi.from_url(url + "/openapi.json")


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


def _check(case, url: str) -> None:
    response = case.call(base_url=url, timeout=120)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400 and response.status_code != 499:
        error = response.json()["error"]
        assert error["message"] and "hint" in error, response.text


def _fuzz(fuzzed, mode: str, examples: int) -> None:
    engine, url, schema = fuzzed
    operations = _operations(schema)
    assert {op.path for op in operations} >= {"/health", "/v1/models", "/v1/generate", "/v1/weights",
                                              "/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        if mode == "negative" and not len(operation.body):
            continue  # nothing to break in a request without a body (GET /health, /v1/models)
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
        settings = hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                       suppress_health_check=list(hypothesis.HealthCheck))

        @settings
        @hypothesis.given(case=strategy)
        def run(case) -> None:
            _check(case, url)

        run()
    # Still answering, and nothing is left holding KV blocks.
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    reply = httpx.post(url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "temperature": 0},
                       timeout=60).json()
    direct = engine.generate(engine.tokenizer.encode("x = "), SamplingParams(max_tokens=4, temperature=0))
    assert reply["choices"][0]["text"] == direct.text


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_is_a_server_error(fuzzed, mode):
    _fuzz(fuzzed, mode, examples=12)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_is_a_server_error_at_length(fuzzed, mode):
    _fuzz(fuzzed, mode, examples=150)
