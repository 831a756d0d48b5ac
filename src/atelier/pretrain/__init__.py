"""Continued pretraining, long-context extension and SFT; base-model evals.

Modules:
- config: the recipe schema (PretrainConfig, phases, sources, evals).
- sources: listing documents, exact dedup, held-out split by repository.
- packing: token shards (memory-mapped, resumable builds) and packed rows.
- corpus: the run's packed corpus (a stream per source, one held out).
- sft_data: chat and trajectory SFT examples with their loss masks.
- batches, schedule: phase batches with a resumable cursor; LR schedule.
- modeling: model loading, rotary-base scaling (devices and precision: `atelier.train`).
- checkpoint, train: the loop (`run_pretrain`) and its checkpoints.
- sft: `sft_on_trajectories` for rejection-sampling SFT.
- perplexity, state_tracking, evals: the base-model evals (`run_base_evals`).

Nothing heavy is imported here; import the module you need.
"""
