"""The local engine against Hugging Face's own forward and generate, alone and under concurrency."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from atelier.inference.engine import EngineError, LocalEngine
from atelier.inference.types import Generation, SamplingParams, TokenModel
from tests.inference.conftest import generate_concurrently

NO_STOP = (10**6,)  # a stop id outside the vocabulary: run to max_tokens
TEXTS = ["def foo(x):", "import json\nclass Decoder", "hello", "x = [1, 2, 3]\nfor i in x:\n    print",
         "a", "The quick brown fox", "return self.value", "{\"name\": \"read_file\"}"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=NO_STOP)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def reference_logprobs(hf_model, prompt: list[int], gen: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + gen])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(gen)[:, None])[:, 0]


def test_is_a_token_model(engine):
    assert isinstance(engine, TokenModel)
    assert engine.version == 0


def test_greedy_equals_hf_generate(engine, hf_model):
    for text in TEXTS[:4]:
        ids = engine.tokenizer.encode(text)
        got = engine.generate(ids, greedy(24))
        assert isinstance(got, Generation) and got.finish_reason == "length"
        assert got.token_ids == hf_greedy(hf_model, ids, 24)
        assert len(set(got.token_ids)) > 3  # the check is not vacuous: outputs vary


def test_chat_prompt_greedy_equals_hf(engine, hf_model):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "fix the bug"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    assert engine.generate(list(ids), greedy(16)).token_ids == hf_greedy(hf_model, list(ids), 16)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_reference_forward(engine, hf_model, temperature, top_p):
    prompt = engine.tokenizer.encode(TEXTS[1])
    got = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=temperature, top_p=top_p,
                                                 seed=5, stop_token_ids=NO_STOP))
    ref = reference_logprobs(hf_model, prompt, got.token_ids, temperature)
    assert torch.allclose(torch.tensor(got.logprobs), ref, atol=1e-4)


def test_greedy_logprobs_are_untempered(engine, hf_model):
    prompt = engine.tokenizer.encode(TEXTS[0])
    got = engine.generate(prompt, greedy(8))
    ref = reference_logprobs(hf_model, prompt, got.token_ids, 1.0)
    assert torch.allclose(torch.tensor(got.logprobs), ref, atol=1e-4)


def test_seed_reproduces_and_differs(engine):
    prompt = engine.tokenizer.encode(TEXTS[2])
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop_token_ids=NO_STOP)
    first, second = engine.generate(prompt, params), engine.generate(prompt, params)
    assert first.token_ids == second.token_ids and first.logprobs == second.logprobs
    others = {tuple(engine.generate(prompt, SamplingParams(max_tokens=24, seed=s, stop_token_ids=NO_STOP)).token_ids)
              for s in range(12, 16)}
    assert len(others | {tuple(first.token_ids)}) > 1


def test_top_p_keeps_only_the_nucleus(engine, hf_model):
    prompt = engine.tokenizer.encode(TEXTS[3])
    got = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-6, seed=1,
                                                 stop_token_ids=NO_STOP))
    # With a tiny nucleus every step keeps only the most likely token: greedy.
    assert got.token_ids == hf_greedy(hf_model, prompt, 20)


def test_concurrent_requests_batch_and_equal_solo(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        lengths = [12 + 5 * i for i in range(8)]  # finish at different steps: slots get compacted
        solo = [engine.generate(p, greedy(n)).token_ids for p, n in zip(prompts, lengths)]
        results = generate_concurrently(engine, prompts, [greedy(n) for n in lengths], timeout=120)
        assert results == solo
        assert engine.stats["max_batch_seen"] > 1


def test_more_requests_than_slots_queue_and_join_midway(spiky_model_dir):
    """With 2 slots and 6 requests, later ones join as earlier ones finish (continuous batching)."""
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=2) as engine:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:6]]
        solo = [engine.generate(p, greedy(6 + 3 * i)).token_ids for i, p in enumerate(prompts)]
        results: list[list[int] | None] = [None] * 6
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, engine.generate(prompts[i], greedy(6 + 3 * i)).token_ids)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == solo
        assert engine.stats["max_batch_seen"] == 2


def test_in_flight_weight_update_changes_versions_mid_generation(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32") as engine:
        prompt = engine.tokenizer.encode(TEXTS[0])
        before = engine.generate(prompt, greedy(40))
        seen, updating = threading.Event(), threading.Event()
        count = [0]

        def on_token(token: int, logprob: float, version: int) -> None:
            count[0] += 1
            if count[0] == 5:  # hold the scheduler here until the update is queued
                seen.set()
                updating.wait(60)
                deadline = time.monotonic() + 60  # until update_weights has queued the update
                while not engine._updates and time.monotonic() < deadline:
                    time.sleep(0.001)

        out: list[Generation] = []
        thread = threading.Thread(target=lambda: out.append(
            engine.generate(prompt, greedy(150), on_token=on_token)))
        thread.start()
        assert seen.wait(60)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()
               if k.endswith("mlp.down_proj.weight")}
        updating.set()
        engine.update_weights(new, version=1)
        assert engine.version == 1
        thread.join(timeout=120)
        gen = out[0]
        assert gen.versions[0] == 0 and gen.versions[-1] == 1
        switch = gen.versions.index(1)
        assert 5 <= switch < len(gen.versions) and gen.versions == [0] * switch + [1] * (len(gen.versions) - switch)
        n = min(switch, 40)
        assert gen.token_ids[:n] == before.token_ids[:n]  # old weights, same tokens up to the swap
        after = engine.generate(prompt, greedy(40))
        assert set(after.versions) == {1} and after.token_ids != before.token_ids


def test_bad_weight_updates_are_refused(engine):
    with pytest.raises(EngineError, match="not a parameter"):
        engine.update_weights({"nope.weight": torch.zeros(1)}, version=9)
    key = "model.norm.weight"
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights({key: torch.zeros(3)}, version=9)
    assert engine.version == 0


def test_update_weights_from_safetensors_path(spiky_model_dir, tmp_path):
    from safetensors.torch import save_file

    with LocalEngine(spiky_model_dir, dtype="float32") as engine:
        key = "model.norm.weight"
        save_file({key: torch.full_like(engine.model.state_dict()[key], 0.5)}, str(tmp_path / "w.safetensors"))
        assert engine.update_weights_from_path(tmp_path, version=3) == 1
        assert engine.version == 3 and torch.all(engine.model.state_dict()[key] == 0.5)
        with pytest.raises(EngineError, match="no safetensors"):
            engine.update_weights_from_path(tmp_path / "missing", version=4)


def test_stop_token_ids(engine):
    prompt = engine.tokenizer.encode(TEXTS[1])
    full = engine.generate(prompt, greedy(30)).token_ids
    stop = full[6]
    got = engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,)))
    assert got.token_ids == full[: full.index(stop) + 1] and got.finish_reason == "stop"


def test_default_stop_is_the_tokenizers_eos(spiky_model_dir, tmp_path):
    """A copy of the model whose tokenizer calls a token greedy produces 'eos' stops there."""
    import shutil

    from transformers import AutoTokenizer

    with LocalEngine(spiky_model_dir, dtype="float32") as engine:
        prompt = engine.tokenizer.encode(TEXTS[1])
        full = engine.generate(prompt, greedy(30)).token_ids
    copy = tmp_path / "model"
    shutil.copytree(spiky_model_dir, copy)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(full[6])
    tokenizer.save_pretrained(copy)
    with LocalEngine(copy, dtype="float32") as engine:
        assert engine.tokenizer.eos_token_id == full[6]
        got = engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0))
    assert got.token_ids == full[: full.index(full[6]) + 1] and got.finish_reason == "stop"


def test_stop_strings_end_generation_at_the_completing_token(engine):
    prompt = engine.tokenizer.encode(TEXTS[0])
    full = engine.generate(prompt, greedy(30))
    text_upto = [engine.tokenizer.decode(full.token_ids[: i + 1]) for i in range(30)]
    target = next(i for i in range(8, 30) if len(text_upto[i]) - len(text_upto[i - 1]) >= 1
                  and text_upto[i][-2:] not in text_upto[i - 1])
    stop = text_upto[target][-2:]
    got = engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=(stop,), stop_token_ids=NO_STOP))
    first = next(i for i in range(30) if stop in text_upto[i])
    assert got.finish_reason == "stop" and got.token_ids == full.token_ids[: first + 1]
    assert stop in got.text


def test_bad_prompts_raise_engine_errors(engine):
    with pytest.raises(EngineError, match="empty"):
        engine.generate([], greedy(2))
    with pytest.raises(EngineError, match="vocabulary"):
        engine.generate([10**7], greedy(2))
    with pytest.raises(EngineError, match="context"):
        engine.generate([1] * (engine.max_seq_len + 1), greedy(2))


def test_context_limit_ends_with_length(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32", max_seq_len=20) as engine:
        got = engine.generate([5] * 15, greedy(100))
        assert got.finish_reason == "length" and len(got.token_ids) == 5


def test_closed_engine_refuses(spiky_model_dir):
    engine = LocalEngine(spiky_model_dir, dtype="float32")
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.generate([1, 2], greedy(2))


def test_a_long_prompt_joining_a_running_request_keeps_both_exact(spiky_model_dir, hf_model):
    """A 300-token prompt (ten KV blocks) joins while a short request decodes: both read their own
    blocks only."""
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=4) as engine:
        long_prompt = engine.tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 40)[:300]
        short_prompt = engine.tokenizer.encode(TEXTS[5])
        started = threading.Event()
        results: dict[str, list[int]] = {}

        def on_token(*_: object) -> None:
            started.set()

        short = threading.Thread(target=lambda: results.__setitem__(
            "short", engine.generate(short_prompt, greedy(60), on_token=on_token).token_ids))
        short.start()
        assert started.wait(60)
        results["long"] = engine.generate(long_prompt, greedy(8)).token_ids
        short.join(timeout=120)
    assert results["long"] == hf_greedy(hf_model, long_prompt, 8)
    assert results["short"] == hf_greedy(hf_model, short_prompt, 60)


def test_bfloat16_engine_runs_close_to_fp32(spiky_model_dir, engine, hf_model):
    """bf16 cannot be token-exact against fp32; what must hold: the first tokens agree, and the
    logprobs it reports for its own tokens are those of its sampling distribution, within bf16
    rounding of an fp32 forward over the same tokens (what the trainer recomputes)."""
    prompt = engine.tokenizer.encode(TEXTS[0])
    ref = engine.generate(prompt, greedy(6))
    with LocalEngine(spiky_model_dir, dtype="bfloat16") as bf16:
        assert bf16.dtype == torch.bfloat16 and bf16.model.dtype == torch.bfloat16
        got = bf16.generate(prompt, greedy(6))
        sampled = [bf16.generate(engine.tokenizer.encode(t), SamplingParams(
            max_tokens=24, temperature=0.7, seed=3, stop_token_ids=NO_STOP)) for t in TEXTS[:3]]
    assert got.token_ids[:2] == ref.token_ids[:2]
    assert abs(got.logprobs[0] - ref.logprobs[0]) < 0.1
    errors = torch.cat([(torch.tensor(g.logprobs) - reference_logprobs(
        hf_model, engine.tokenizer.encode(t), g.token_ids, 0.7)).abs() for g, t in zip(sampled, TEXTS)])
    print(f"bf16 vs fp32 logprobs: mean {errors.mean():.4f}, max {errors.max():.4f}")
    assert errors.mean() < 0.1 and errors.max() < 0.5
    assert errors.max() > 0  # really computed in another precision
    with pytest.raises(EngineError, match="unknown dtype"):
        LocalEngine(spiky_model_dir, dtype="int3")


def test_weight_update_reaches_fused_projections(spiky_model_dir):
    """q/k/v and gate/up run as fused matmuls over views of the model's parameters: an update of
    those parameters must change exactly what Hugging Face's forward with the same weights gives."""
    from transformers import AutoModelForCausalLM

    with LocalEngine(spiky_model_dir, dtype="float32") as engine:
        prompt = engine.tokenizer.encode(TEXTS[3])
        before = engine.generate(prompt, greedy(20)).token_ids
        g = torch.Generator().manual_seed(1)
        new = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in engine.model.state_dict().items()
               if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                              "up_proj.weight"))}
        engine.update_weights(new, version=1)
        got = engine.generate(prompt, greedy(20)).token_ids
    ref = AutoModelForCausalLM.from_pretrained(spiky_model_dir).eval()
    ref.load_state_dict(new, strict=False)
    assert got == hf_greedy(ref, prompt, 20) and got != before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_requests_are_bitwise_their_solo_selves(spiky_model_dir, dtype):
    """With batch_invariant=True a request's tokens and logprobs are bit for bit those it gets alone,
    while others of the same prompt (which would share its prefix-cache blocks) run beside it."""
    with LocalEngine(spiky_model_dir, dtype=dtype, max_batch=8, batch_invariant=True) as engine:
        prompt = engine.tokenizer.encode(" ".join(TEXTS) * 2)   # over one KV block: cacheable
        params = [SamplingParams(max_tokens=40 + 3 * i, temperature=1.0, seed=i, stop_token_ids=NO_STOP)
                  for i in range(6)]
        solo = [engine.generate(prompt, p) for p in params]
        handles = []
        for p in params:   # each arrives while the ones before it decode: later ones would hit the cache
            started = threading.Event()
            handles.append(engine.submit(prompt, p, on_token=lambda *_, e=started: e.set()))
            assert started.wait(timeout=120)
        results = [h.result(timeout=120) for h in handles]
        assert [(r.token_ids, r.logprobs) for r in results] == [(g.token_ids, g.logprobs) for g in solo]
        assert engine.stats["max_batch_seen"] > 1 and engine.stats["prefix_hit_tokens"] == 0


def test_scored_prompts_have_the_reference_logprobs_at_every_position(engine, hf_model):
    """`prompt_logprobs`: each prompt token's logprob given the ones before it (None first) and the
    most likely tokens there, equal to the model's own forward; with max_tokens 0 nothing is
    generated; a prompt whose prefix is cached is still scored whole."""
    prompt = engine.tokenizer.encode(TEXTS[1] + " " + TEXTS[3])
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    engine.generate(prompt, greedy(2))             # now its blocks are in the prefix cache
    scored = engine.generate(prompt, SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=3))
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert scored.prompt_logprobs[0] is None and scored.prompt_top_logprobs[0] is None
    got = torch.tensor(scored.prompt_logprobs[1:])
    torch.testing.assert_close(got, want[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-5, rtol=1e-5)
    for position, top in enumerate(scored.prompt_top_logprobs[1:]):
        assert [t for t, _ in top] == want[position].topk(3).indices.tolist()
    both = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=2,
                                                  prompt_logprobs=0, stop_token_ids=NO_STOP))
    assert both.prompt_top_logprobs is None and both.prompt_logprobs == scored.prompt_logprobs
    assert len(both.top_logprobs) == 4 and all(top[0][0] == t for top, t in zip(both.top_logprobs, both.token_ids))
    with pytest.raises(EngineError, match="max_tokens"):
        engine.generate(prompt, SamplingParams(max_tokens=0))
