"""Base-model evals, used to pick and track base models instead of agent benchmarks.

`run_base_evals(model, repos, config)` measures codebase perplexity on each
repository and state tracking on file histories generated from the same
repositories' files, writes `evals.json` and `evals.png` when given an output
directory, and returns the results.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from atelier.pretrain.config import BaseEvalConfig
from atelier.pretrain.modeling import load_model_and_tokenizer
from atelier.pretrain.perplexity import EvalError, codebase_perplexity, repo_files
from atelier.pretrain.plots import plot_evals
from atelier.pretrain.state_tracking import histories_from_files, state_tracking


def run_base_evals(model_spec: str, repos: Sequence[str | Path], config: BaseEvalConfig | None = None,
                   *, out_dir: str | Path | None = None, device: str = "cpu") -> dict[str, Any]:
    config = config or BaseEvalConfig()
    if not repos:
        raise EvalError("no repositories to evaluate on",
                        hint="pass --repo DIR (held-out code the model has not trained on)")
    model, tokenizer = load_model_and_tokenizer(model_spec, device)
    per_repo = [codebase_perplexity(model, tokenizer, repo, window=config.window, stride=config.stride,
                                    include=config.include, max_tokens=config.max_repo_tokens,
                                    device=device) for repo in repos]
    scored = sum(r["scored"] for r in per_repo)
    nll = sum(r["nll_per_token"] * r["scored"] for r in per_repo) / max(scored, 1)
    files = [f for repo in repos for f in repo_files(repo, config.include)]
    histories = histories_from_files(files, config.histories, config.diffs_per_history,
                                     config.max_file_chars, config.seed)
    results = {
        "model": model_spec,
        "perplexity": {"nll_per_token": nll, "perplexity": math.exp(min(nll, 50.0)), "tokens": scored,
                       "window": config.window, "stride": config.stride, "repos": per_repo},
        "state_tracking": state_tracking(model, tokenizer, histories, config.max_new_tokens, device),
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "evals.json").write_text(json.dumps(results, indent=1) + "\n")
        plot_evals(results, out / "evals.png")
    return results
