"""Fixtures for the pretrain tests: a tokenizer and small code repositories."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_repos(root: Path, n_repos: int = 4, files: int = 3) -> Path:
    """`n_repos` little repositories of repetitive Python, each under its own directory."""
    for r in range(n_repos):
        for f in range(files):
            path = root / f"repo{r}" / ("pkg" if f % 2 else "") / f"mod{f}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            body = "".join(f"def add_{r}_{f}_{i}(a, b):\n    return a + b + {i}\n\n" for i in range(12))
            path.write_text(body)
    return root


@pytest.fixture
def code_root(tmp_path: Path) -> Path:
    return write_repos(tmp_path / "code")
