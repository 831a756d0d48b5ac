"""Evaluation: run a model on a task suite several times, measure it, report it.

- `records`: one `EvalRecord` per task and pass, the run directory's layout,
  the append-only results file.
- `metrics` (pure): accuracy with a confidence interval, unbiased pass@k,
  best-of-K, cost, latency, tokens, turns, tool calls; infrastructure errors
  counted apart.
- `prices`: the per-model price table (`prices.toml`, editable) and cost.
- `runner`: `run_eval(model, tasks, out_dir, ...)`: sandbox per attempt, the
  harness's agent loop, grading in a fresh sandbox, resumable.
- `report`, `plots`, `viewer`: one self-contained HTML page over run
  directories.

Heavy parts are not imported here: `from atelier.eval.runner import run_eval`.
"""
