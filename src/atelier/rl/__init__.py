"""Asynchronous RL: objective, shaping, reconciler, trainer, weight sync, checkpoints."""
