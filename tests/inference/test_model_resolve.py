"""Resolving model specs: directories, known names, hub ids; the error that says how to get one."""

from __future__ import annotations

import pytest

from atelier.errors import AtelierError
from atelier.inference.models import COMPLETE_MARKER, ModelNotFound, known_model_dir, open_model, resolve_model


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def test_missing_known_model_says_how_to_pull():
    with pytest.raises(ModelNotFound) as info:
        resolve_model("smollm2-135m")
    assert isinstance(info.value, AtelierError)
    assert "atelier models pull smollm2-135m" in info.value.hint
    assert "not been pulled" in info.value.message


def test_unknown_name_and_uncached_hub_id_and_bad_dir(tmp_path):
    with pytest.raises(ModelNotFound, match="no model named"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache") as info:
        resolve_model("someone/some-model")
    assert "atelier models pull" in info.value.hint
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model(tmp_path)


def test_directory_and_pulled_known_name_resolve(tiny_model_dir):
    import shutil

    assert resolve_model(tiny_model_dir) == tiny_model_dir
    target = known_model_dir("smollm2-135m")
    shutil.copytree(tiny_model_dir, target)
    with pytest.raises(ModelNotFound):  # a directory without the completion marker is a broken pull
        resolve_model("smollm2-135m")
    (target / COMPLETE_MARKER).write_text("")
    assert resolve_model("SmolLM2-135M") == target


def test_open_model_gives_a_local_engine(tiny_model_dir):
    from atelier.inference.engine import LocalEngine

    with open_model(tiny_model_dir, max_batch=2) as engine:
        assert isinstance(engine, LocalEngine)
        assert engine.generate([1, 2, 3]).token_ids
        assert engine.prefix_cache.enabled  # on by default, for every CLI path that opens a model
    with open_model(tiny_model_dir, prefix_cache_tokens=0) as engine:
        assert not engine.prefix_cache.enabled
