"""Fixtures for the inference tests: a tiny model with spread-out logits, and engines over it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spiky_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model initialised with larger weights, so greedy outputs vary from token to token.

    The default tiny model's logits are nearly flat and its greedy output repeats one token,
    which would make "equals the reference" checks weak.
    """
    from atelier.inference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("spiky-model"), initializer_range=0.2)


@pytest.fixture(scope="module")
def engine(spiky_model_dir):
    from atelier.inference.engine import LocalEngine

    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(spiky_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spiky_model_dir).eval()
