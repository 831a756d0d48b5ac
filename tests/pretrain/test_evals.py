"""Base-model evals: codebase perplexity against a hand computation, the state-tracking scorer."""

from __future__ import annotations

import json
import random

import pytest

from atelier.pretrain.perplexity import EvalError, codebase_perplexity, repo_text, rolling_nll
from atelier.pretrain.state_tracking import edit_similarity, levenshtein, make_history


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from atelier.pretrain.modeling import load_model_and_tokenizer

    return load_model_and_tokenizer(str(tiny_model_dir))


def _hand_nll(model, ids: list[int], context_start) -> float:
    """Mean of -log p(x_t | x_[context_start(t):t]), one forward pass per token."""
    import torch

    total = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            ctx = torch.tensor([ids[context_start(t):t]])
            logprobs = torch.log_softmax(model(input_ids=ctx).logits[0, -1].double(), dim=-1)
            total -= float(logprobs[ids[t]])
    return total / (len(ids) - 1)


@pytest.mark.parametrize("window,stride", [(64, 32), (16, 8), (16, 5)])
def test_rolling_nll_equals_the_hand_computed_mean(tiny_model, window, stride) -> None:
    model, _ = tiny_model
    ids = [random.Random(0).randrange(300) for _ in range(40)]

    def context_start(t: int) -> int:  # the first window (start k*stride) that reaches past t scores t
        begin = 0
        while min(begin + window, len(ids)) <= t:
            begin += stride
        return begin

    total, count = rolling_nll(model, ids, window, stride)
    assert count == len(ids) - 1
    assert total / count == pytest.approx(_hand_nll(model, ids, context_start), rel=1e-5)
    if window >= len(ids):
        assert total / count == pytest.approx(_hand_nll(model, ids, lambda t: 0), rel=1e-5)


def test_repository_files_join_in_alphabetical_order(tmp_path, tiny_model) -> None:
    model, tokenizer = tiny_model
    for name, text in [("b.py", "B = 2\n"), ("a.py", "A = 1\n"), ("sub/c.py", "C = 3\n"), ("z.txt", "no")]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert repo_text(tmp_path) == "A = 1\n\n\nB = 2\n\n\nC = 3\n\n\n"
    result = codebase_perplexity(model, tokenizer, tmp_path, window=8, stride=4)
    ids = tokenizer(repo_text(tmp_path), add_special_tokens=False)["input_ids"]
    assert result["scored"] == len(ids) - 1
    assert result["nll_per_token"] == pytest.approx(rolling_nll(model, ids, 8, 4)[0] / (len(ids) - 1))
    with pytest.raises(EvalError, match="stride"):
        rolling_nll(model, ids, 8, 8)
    with pytest.raises(EvalError, match="no readable files"):
        codebase_perplexity(model, tokenizer, tmp_path, include=["*.rs"])


def _reference_levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_state_tracking_scorer_on_known_pairs() -> None:
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("héllo", "hello") == 1
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("", "abcd") == 0.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    rng = random.Random(1)
    for _ in range(50):
        a = "".join(rng.choice("ab\n ") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("ab\n ") for _ in range(rng.randrange(12)))
        assert levenshtein(a, b) == _reference_levenshtein(a, b)


def test_histories_chain_real_diffs() -> None:
    import inspect
    import textwrap

    text = inspect.getsource(textwrap.dedent)
    history = make_history("textwrap.py", text, n_diffs=4, seed=3)
    assert len(history.diffs) == 4 and all(d.startswith("--- a/textwrap.py") for d in history.diffs)
    assert history.final != history.original
    assert make_history("textwrap.py", text, 4, 3) == history  # seeded
    prompt = history.prompt()
    assert prompt.endswith("<final>\n") and history.original in prompt and history.final not in prompt
    assert edit_similarity(history.final, history.final) == 1.0 > edit_similarity(history.original, history.final)


def test_base_eval_cli_json(tmp_path, tiny_model_dir) -> None:
    from typer.testing import CliRunner

    from atelier.cli.main import app

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "m.py").write_text("def f(x):\n    y = x + 1\n    return y\n\n" * 3)
    result = CliRunner().invoke(app, ["base-eval", "--model", str(tiny_model_dir), "--repo", str(repo),
                                      "--set", "window=32", "--set", "stride=16", "--set", "max_new_tokens=8",
                                      "--run-dir", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["perplexity"]["repos"][0]["scored"] > 0
    assert len(data["state_tracking"]["items"]) == 1
    assert 0 <= data["state_tracking"]["mean_score"] <= 1
    assert (tmp_path / "out" / "evals.png").stat().st_size > 0
