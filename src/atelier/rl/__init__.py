"""Asynchronous RL: objective, shaping, reconciler, trainer, weight sync, checkpoints.

- `loss`, `advantages`, `shaping`: the objective as pure functions (a sample leaves `advantages`
  with the advantage the trainer uses).
- `ledger`: the slot ledger (queued -> running -> graded -> ready -> trained | dropped), append-only.
- `reconciler`: admission (staleness bound), retries, groups, batches.
- `trainer`, `checkpoint`: full-parameter AdamW on a Hugging Face model (on `atelier.train`'s
  ranks); step checkpoints. `mirror`: rank 0's trainer calls mirrored on the other ranks.
- `weight_sync`: `WeightSync.publish/latest`, in-process and XOR delta chain.
- `env` (toy environment, `Environment` protocol), `task_env` (real tasks through the harness).
- `backends` (threads, one process) and `ray_backend` (Ray actors; with `atelier.train.launch_ray`
  and `atelier.sandbox.ray_pool`, one of the three modules that import ray).
- `run`: `run_training(config, run_dir) -> TrainSummary`, the driver.

Heavy modules are not imported here: `from atelier.rl.run import run_training`.
"""
