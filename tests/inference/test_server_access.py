"""Who gets in: the API key on every endpoint but /health, and `/v1/weights` off unless the server
names a directory, then confined to it (no path out, no symbolic link out)."""

from __future__ import annotations

import httpx
import pytest

from atelier.inference.client import GenerateClient, ServerError
from atelier.inference.types import SamplingParams
from tests.inference.conftest import atelier_serve, serving

openai = pytest.importorskip("openai")
KEY = "s3cret-key"
MESSAGES = [{"role": "user", "content": "Fix the failing test in src/app.py"}]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def guarded(engine, weights_dir):
    with serving(engine, api_key=KEY, weights_dir=weights_dir) as url:
        yield engine, url


def _norm_weights(engine, path) -> None:
    from safetensors.torch import save_file

    key = "model.norm.weight"
    save_file({key: engine.model.state_dict()[key].clone()}, str(path))


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/generate",
                                  "/v1/weights", "/openapi.json", "/docs", "/no/such/path"])
def test_every_path_but_health_needs_the_key(guarded, path):
    _, url = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}):
        response = httpx.request("GET" if path in ("/v1/models", "/openapi.json", "/docs") else "POST", url + path,
                                 json={}, headers=headers, timeout=30)
        assert response.status_code == 401, (path, headers)
        assert response.json()["error"]["code"] == "invalid_api_key" and "ATELIER_API_KEY" in response.json()[
            "error"]["hint"]
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200


def test_clients_with_the_key_get_in_and_without_it_are_told(guarded):
    engine, url = guarded
    reply = openai.OpenAI(base_url=url + "/v1", api_key=KEY).chat.completions.create(
        model=engine.name, messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).completions.create(
            model=engine.name, prompt="x", max_tokens=2)
    with GenerateClient(url, api_key=KEY) as client:
        ids = client.tokenizer.encode("import os")
        assert client.generate(ids, SamplingParams(max_tokens=3, temperature=0)).token_ids
    with pytest.raises(ServerError, match="401") as info:
        GenerateClient(url)
    assert "Bearer" in info.value.hint


def test_weights_load_from_under_the_directory(guarded, weights_dir):
    engine, url = guarded
    (weights_dir / "step-1").mkdir()
    _norm_weights(engine, weights_dir / "step-1" / "model.safetensors")
    with GenerateClient(url, api_key=KEY) as client:
        for path in ("step-1", str(weights_dir / "step-1"), "step-1/model.safetensors", "./step-1/../step-1"):
            version = engine.version + 1
            assert client.update_weights_from_path(path, version) == 1
            assert client.version == version


def test_weights_paths_out_of_the_directory_are_refused(guarded, weights_dir, tmp_path):
    engine, url = guarded
    outside = tmp_path / "outside.safetensors"
    _norm_weights(engine, outside)
    (weights_dir / "link.safetensors").symlink_to(outside)
    (weights_dir / "linked-dir").symlink_to(tmp_path, target_is_directory=True)
    (weights_dir / "mixed").mkdir()
    _norm_weights(engine, weights_dir / "mixed" / "a.safetensors")
    (weights_dir / "mixed" / "b.safetensors").symlink_to(outside)
    before = engine.version
    for path in (str(outside), "../" + outside.name, "link.safetensors", "linked-dir", "mixed", "/etc/passwd"):
        response = httpx.post(url + "/v1/weights", json={"path": path, "version": before + 1},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert "outside the weights directory" in error["message"] and error["param"] == "path"
    (weights_dir / "junk.safetensors").write_bytes(b"not safetensors")
    for path, words in (("junk.safetensors", "cannot read"), ("missing", "no safetensors"), ("a\x00b", "cannot be")):
        response = httpx.post(url + "/v1/weights", json={"path": path, "version": before + 1},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert engine.version == before


def test_weight_updates_are_off_unless_a_directory_is_named(engine, tmp_path):
    _norm_weights(engine, tmp_path / "w.safetensors")
    before = engine.version
    with serving(engine) as url:
        response = httpx.post(url + "/v1/weights", json={"path": str(tmp_path / "w.safetensors"), "version": 9},
                              timeout=30)
        assert response.status_code == 404 and "--enable-weight-updates" in response.json()["error"]["hint"]
        missing = httpx.get(url + "/v1/nothing-here", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert engine.version == before


def test_atelier_serve_takes_the_key_from_its_environment_and_warns_when_open(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--host", "0.0.0.0"]
    cache = {"ATELIER_CACHE": str(tmp_path / "cache")}
    with atelier_serve(common, {**cache, "ATELIER_API_KEY": KEY}) as (url, stderr):
        assert "warning" not in stderr and "API key required" in stderr
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
        weights = httpx.post(url + "/v1/weights", json={"path": "x", "version": 1},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert weights.status_code == 404
    with atelier_serve(common, cache) as (url, stderr):
        assert "warning: serving on 0.0.0.0 without an API key" in stderr
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
