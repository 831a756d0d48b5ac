"""Tiny, randomly initialised models built from a config, for tests and smoke runs.

`build_tiny_model(out_dir)` writes a complete Hugging Face model directory —
a byte-level BPE tokenizer trained on a few standard-library modules, a
ChatML chat template (the format SmolLM2-Instruct uses, so prompts look the
same as with the real model) and a Llama-architecture model of well under a
million parameters — in about a second, with no download. Every byte can be
encoded, so any text round-trips.

`build_tiny_model(out_dir, moe=True)` (the model name "tiny-moe") writes a
Mixtral-architecture model instead: Mistral attention, every layer a sparse
block of 8 SwiGLU experts behind a top-2 softmax router; dimensions are
multiples of 32 so the low-precision expert kernels (atelier.kernels)
apply. Mixtral rather than Qwen3-MoE or OLMoE because its attention is the
one the local engine's batched forward already runs (those two add q/k
norms); router replay and the kernels work on all three.
"""

from __future__ import annotations

import inspect
import json
import shlex
import string
import textwrap
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    texts = [inspect.getsource(m) for m in (textwrap, shlex, string, json.decoder)]
    # The harness's own vocabulary, so tool calls are short token sequences.
    texts.append(
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a.py", "old_string": "x", '
        '"new_string": "y"}}\n</tool_call>\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>\n'
    )
    return texts


def build_tiny_tokenizer(vocab_size: int = 512):
    """A `PreTrainedTokenizerFast` with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


# What every tiny model shares: the dense one and the MoE one differ only in their MLPs.
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True)


def tiny_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_SHAPE, "vocab_size": vocab_size, "intermediate_size": 128, **overrides})


# The same parameter shapes with head_dim 32, the smallest vLLM's CPU attention runs (16 fails
# at the first request): what `tiny` builds when vLLM samples.
VLLM_SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def tiny_moe_config(vocab_size: int, **overrides):
    from transformers import MixtralConfig

    moe = dict(
        intermediate_size=32,            # per expert
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
        head_dim=16,
        router_aux_loss_coef=0.0,
    )
    return MixtralConfig(**{**TINY_SHAPE, "vocab_size": vocab_size, **moe, **overrides})


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512, moe: bool = False,
                     **config_overrides) -> Path:
    """Write a tiny Llama (or, with `moe`, Mixtral) model and its tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size)
    config = (tiny_moe_config if moe else tiny_config)(len(tokenizer), **config_overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "atelier_model.json").write_text(json.dumps({"source": "tiny-moe" if moe else "tiny", "seed": seed}) + "\n")
    return out
