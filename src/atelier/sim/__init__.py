"""`atelier simulate`: the asynchronous RL pipeline as a discrete-event simulation (SimPy).

- `cluster`: the cluster file (pydantic, TOML): trainer, inference, sandboxes, the shared host,
  weight sync, regions and links, the workload, faults, and where each number comes from.
- `fluid`: the one queueing model, a shared server (continuous batching, links, cores).
- `workload`: rollout profiles, replayed from a run or drawn from distributions.
- `state`: the simulated reconciler, moved by `atelier.rl.rules` (the reconciler's own rules).
- `pipeline`: the SimPy processes: trainer, rollouts, weight sync (`atelier.rl.chain`),
  placement and admission (`atelier.sandbox.pool.least_loaded`,
  `atelier.sandbox.pressure.admission_wait_reason`), faults and recovery.
- `calibrate`, `predict`: a run directory's components measured, and any recipe's run
  predicted from them; `results`: the figures a run and its prediction are compared by.
- `sweep`, `plots`: projection over GPU splits, staleness bounds, async against sync, outages.
- `commands`: what the CLI's subcommands do (`atelier.cli.simulate`).

docs/guides/simulate.md is the user's guide.
"""
