"""The trainer-rank machinery shared by RL (`atelier.rl.trainer`) and pretrain/SFT
(`atelier.pretrain.train`), one concept a module. Nothing here knows about tasks,
rollouts or the RL objective; the trainers call these and never branch on the
number of ranks themselves.

- `ranks`: a rank's lifecycle: torchrun's environment contract, the process
  group (NCCL on CUDA, gloo on the CPU, every collective with a timeout), how a
  rank process ends;
- `devices`: the device a rank uses, the precision it computes in, bf16 on the
  CPU, and how CPU memory is handed back;
- `fsdp`: FSDP2 sharding per decoder layer, mixed precision, activation
  checkpointing, and the one-rank equivalent of FSDP's bf16 policy;
- `head`: `PolicyHead`, a causal LM whose forward returns token logprobs,
  computed in chunks, never full logits;
- `prefix`: a step's samples as a tree of the token runs they share, each run
  forward once (`SharedPrefix`), over a key/value cache that never grows;
- `batching`: token-balanced partition of a step's samples over ranks and
  micro-batches;
- `collectives`: all-reduces, barrier, global gradient clipping, and
  collective failures named as such;
- `checkpoint`: the full weights gathered on rank 0, and sharded model and
  optimizer state (torch.distributed.checkpoint);
- `launch`: N local ranks under torchrun's elastic agent; `launch_ray`: N ranks
  as Ray actors in a placement group.
"""
