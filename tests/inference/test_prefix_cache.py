"""Prefix caching: the same tokens with and without it, bounded, and dropped by a weight update."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from atelier.inference.engine import EngineError, LocalEngine
from atelier.inference.prefix_cache import BlockPool
from atelier.inference.types import Generation, SamplingParams

NO_STOP = (10**6,)
SYSTEM = ("You are a coding agent. Tools: read_file(path), edit_file(path, old_string, new_string), "
          "run_terminal(command), submit(message). Call them as <tool_call>{...}</tool_call>. " * 3)
TASKS = ["fix the failing test in utils.py", "rename foo to bar", "add a docstring",
         "the parser drops empty lines", "make sort stable", "json output has trailing commas"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=NO_STOP)


def chat(tokenizer, task: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def episode(engine: LocalEngine, task: str, turns: int = 4) -> list[Generation]:
    """An agent-like episode: each turn's prompt extends the last prompt, its reply and a tool output."""
    prompt = chat(engine.tokenizer, task)
    replies = []
    for turn in range(turns):
        gen = engine.generate(prompt, greedy(12 + 3 * turn))
        replies.append(gen)
        reply = gen.token_ids
        tool = engine.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\nexit code {turn}: ok\n<|im_end|>\n"
                                       "<|im_start|>assistant\n")
        prompt = prompt + reply + tool
    return replies


def same(got: list[Generation], want: list[Generation]) -> bool:
    """Token-identical, and logprobs equal up to float rounding (which a wrong mask would exceed)."""
    return all(g.token_ids == w.token_ids and torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                                             atol=1e-4) for g, w in zip(got, want, strict=True))


def concurrent(engine: LocalEngine, prompts: list[list[int]], n: int) -> list[Generation]:
    results: list[Generation | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = engine.generate(prompts[i], greedy(n))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def plain(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8, prefix_cache_tokens=0) as eng:
        yield eng


def test_multi_turn_episode_is_token_identical_and_reuses_the_previous_turn(spiky_model_dir, plain):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as cached:
        for task in TASKS[:2]:
            got = episode(cached, task)
            assert same(got, episode(plain, task))
            assert len({t for gen in got for t in gen.token_ids}) > 5  # outputs vary: the check has teeth
        # Turns after the first restore (nearly) all of the previous turn's context.
        assert cached.stats["prefix_hit_tokens"] > cached.stats["prefill_tokens"]
    assert plain.stats["prefix_hit_tokens"] == 0 and plain.prefix_cache.tokens == 0


def test_concurrent_requests_share_the_system_prompt(spiky_model_dir, plain):
    prompts = [chat(plain.tokenizer, t) for t in TASKS]
    want = [plain.generate(p, greedy(16)) for p in prompts]
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as cached:
        assert same(concurrent(cached, prompts, 16), want)
        total = sum(len(p) for p in prompts)
        # The shared system prompt was computed once, by the first request; the others waited a step.
        shared = len(chat(cached.tokenizer, "")) // cached.prefix_cache.block * cached.prefix_cache.block
        assert shared >= 64
        assert cached.stats["prefix_hit_tokens"] >= (len(prompts) - 1) * (shared - cached.prefix_cache.block)
        assert cached.stats["prefill_tokens"] + cached.stats["prefix_hit_tokens"] == total
        assert cached.stats["prefills"] >= 2


def test_a_repeated_prompt_still_computes_its_last_token(spiky_model_dir, plain):
    prompt = chat(plain.tokenizer, TASKS[0])[:96]  # ends exactly on a block boundary
    with LocalEngine(spiky_model_dir, dtype="float32") as cached:
        first = cached.generate(prompt, greedy(10))
        again = cached.generate(prompt, greedy(10))
        assert cached.stats["prefix_hit_tokens"] == 64 and cached.stats["prefill_tokens"] == 96 + 32
    assert first.token_ids == again.token_ids == plain.generate(prompt, greedy(10)).token_ids
    assert first.logprobs == pytest.approx(again.logprobs, abs=1e-5)


def test_small_budget_stays_bounded_and_exact(spiky_model_dir, plain):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8, prefix_cache_tokens=64) as cached:
        assert same(episode(cached, TASKS[2], turns=3), episode(plain, TASKS[2], turns=3))
        assert 0 < cached.prefix_cache.tokens <= 64
        assert cached.stats["prefix_hit_tokens"] > 0
    with pytest.raises(EngineError, match="prefix_cache_tokens"):
        LocalEngine(spiky_model_dir, dtype="float32", prefix_cache_tokens=-1)


def _perturbed(engine: LocalEngine) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in engine.model.state_dict().items()
            if k.endswith(("k_proj.weight", "v_proj.weight"))}


def test_weight_update_drops_the_cache(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32") as cached, \
            LocalEngine(spiky_model_dir, dtype="float32", prefix_cache_tokens=0) as ref:
        prompt = chat(cached.tokenizer, TASKS[3])
        before = cached.generate(prompt, greedy(16))
        assert cached.prefix_cache.tokens > 0
        new = _perturbed(cached)
        cached.update_weights(new, version=1)
        ref.update_weights(new, version=1)
        assert cached.prefix_cache.tokens == 0
        hits = cached.stats["prefix_hit_tokens"]
        after = cached.generate(prompt, greedy(16))
        assert cached.stats["prefix_hit_tokens"] == hits  # nothing computed by the old weights was reused
        assert after.token_ids == ref.generate(prompt, greedy(16)).token_ids
        assert after.token_ids != before.token_ids and set(after.versions) == {1}


def test_a_request_that_spans_an_update_is_not_cached(spiky_model_dir):
    """Its keys and values mix two weight versions: reusing them would serve stale context."""
    with LocalEngine(spiky_model_dir, dtype="float32") as engine:
        prompt = chat(engine.tokenizer, TASKS[4])
        seen, updating = threading.Event(), threading.Event()
        count = [0]

        def on_token(token: int, logprob: float, version: int) -> None:
            count[0] += 1
            if count[0] == 3:
                seen.set()
                updating.wait(60)
                time.sleep(0.05)

        out: list[Generation] = []
        thread = threading.Thread(target=lambda: out.append(engine.generate(prompt, greedy(40), on_token=on_token)))
        thread.start()
        assert seen.wait(60)
        updating.set()
        engine.update_weights(_perturbed(engine), version=1)
        thread.join(timeout=120)
        assert out[0].versions[0] == 0 and out[0].versions[-1] == 1
        assert engine.prefix_cache.tokens == 0
        # A request entirely on the new weights is cached again.
        engine.generate(prompt, greedy(4))
        assert engine.prefix_cache.tokens > 0


def test_block_pool_matches_whole_blocks_and_evicts_chain_ends_first():
    pool = BlockPool(num_blocks=8, block=4, cache_blocks=4)
    a = list(range(13))                                   # 3 full blocks and one partial
    table_a = pool.allocate(4)
    assert pool.register(a, table_a, len(a)) == 3 and pool.tokens == 12
    hit = pool.match(pool.keys_for(a[:9] + [99, 98]))    # shares 2 blocks, then diverges
    assert hit == table_a[:2]
    pool.release(hit)
    assert len(pool.match(pool.keys_for(a[:8]))) == 1    # leaves at least one token to compute
    assert pool.match(pool.keys_for([7] + a[1:12])) == []  # a different first block: no match at all
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57, 58]     # shares block 0 with a
    table_b = pool.allocate(4)
    assert pool.register(b, table_b, len(b)) == 2        # its block 0 duplicates a's: stays private
    assert pool.tokens == 16                              # 5 made, 4 kept: a's last block went first
    assert len(pool.match(pool.keys_for(a))) == 2
    assert len(pool.match(pool.keys_for(b))) == 3
    pool.clear()
    assert pool.tokens == 0 and pool.match(pool.keys_for(a)) == []
    assert not BlockPool(4, 4, cache_blocks=0).enabled


def test_block_pool_allocates_within_its_blocks_and_reuses_idle_cached_ones():
    pool = BlockPool(num_blocks=4, block=4)
    first = pool.allocate(3)
    assert pool.allocate(2) is None and pool.available == 1   # all or nothing
    pool.register(list(range(12)), first, 12)                 # all three are full: registered
    pool.release(first)
    assert pool.used == 0 and pool.available == 4             # idle cached blocks count as available
    again = pool.match(pool.keys_for(list(range(13))))        # a later request reuses them, no copy
    assert again == first and pool.used == 3
    pool.release(again)
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3] and pool.tokens < 12  # evicted to make room
    assert pool.peak_used == 4
