"""Decode reads the KV cache in place: blocks handed out consecutively, and the same logprobs
whatever the block layout (forward.py's runs, prefix_cache.py's placement)."""

from __future__ import annotations

import random

import pytest
import torch

from atelier.inference.engine import LocalEngine
from atelier.inference.forward import MAX_RUNS, MIN_SHARED_BLOCKS, BatchedForward, runs, shared_prefixes
from atelier.inference.prefix_cache import BlockPool
from atelier.inference.types import SamplingParams
from tests.inference.conftest import generate_concurrently

NO_STOP = (10**6,)


def test_runs_merge_consecutive_blocks_and_cut_at_jumps():
    assert runs([4, 5, 6, 9, 10], 150, 32) == [(128, 96), (288, 54)]
    assert runs([7], 1, 32) == [(224, 1)]
    assert runs([3, 2], 64, 32) == [(96, 32), (64, 32)]     # descending ids are a jump too


def test_shared_prefixes_group_tables_by_their_common_leading_blocks():
    """Groups are sequences whose tables begin with the same blocks: at least two members, at
    least MIN_SHARED_BLOCKS shared, and never a member's current block (its new key goes there)."""
    n = MIN_SHARED_BLOCKS
    common = list(range(n + 2))
    tables = [common + [20], common + [30], common[:n] + [40, 41, 42], [50] + common[1:], common + [60]]
    positions = [4 * (n + 2), 4 * (n + 2) + 1, 4 * (n + 3), 4 * (n + 2), 4 * (n + 1) + 3]
    # sequence 4 is still writing its block n + 1: the group shares only the n blocks below it
    assert shared_prefixes(tables, positions, 4) == [([0, 1, 2, 4], n)]
    assert shared_prefixes(tables[:2], positions[:2], 4) == [([0, 1], n + 2)]
    assert shared_prefixes([common, common[:n - 1] + [70]], [4 * (n + 2) - 1, 4 * n], 4) == []  # too short
    assert shared_prefixes([common], [4 * n + 9], 4) == []                                        # alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_a_shared_prefix_matches_attending_it_per_sequence(spiky_model_dir, dtype):
    """Sequences whose tables share a prompt's blocks, decoded with that prompt attended once for
    all of them and attended per sequence: the same logits up to rounding (fp32) and the same
    greedy tokens, and only the first reads the shared rows once."""
    fw = _tiny_forward(spiky_model_dir, dtype)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(4 * MIN_SHARED_BLOCKS + 6)]
    shared = len(prompt) // 4                      # full blocks of the prompt: what a prefix cache shares
    fw.prefill([(prompt, 0, list(range(shared + 1)))])
    tails = [[(11 * i + 5 * j) % 200 + 5 for i in range(3 + 5 * j)] for j in range(3)]
    tables, contexts = [], []
    for j, tail in enumerate(tails):
        context = prompt + tail
        table = list(range(shared)) + list(range(20 + 10 * j, 30 + 10 * j))
        fw.prefill([(context, 4 * shared, table)])
        tables.append(table)
        contexts.append(context)
    seen = {}
    for cascade in (True, False):
        fw.cascade = cascade
        before = fw.stats["shared_rows"]
        steps, tokens = [], [list(c) for c in contexts]
        for _ in range(6):
            logits = fw.decode([t[-1] for t in tokens], [len(t) - 1 for t in tokens], tables)
            steps.append(logits)
            for t, row in zip(tokens, logits):
                t.append(int(row.argmax()))
        seen[cascade] = (torch.stack(steps), tokens, fw.stats["shared_rows"] - before)
    assert seen[True][2] == 6 * 4 * shared and seen[False][2] == 0
    assert seen[True][1] == seen[False][1]
    if dtype == torch.float32:
        torch.testing.assert_close(seen[True][0], seen[False][0], atol=1e-4, rtol=1e-4)


def test_interleaved_growth_keeps_every_sequence_consecutive():
    """Sequences that take one block at a time in turn (a decode batch crossing block boundaries)
    each stay one run, and a new sequence lands where neither it nor its neighbour is cut off."""
    pool = BlockPool(num_blocks=64, block=4)
    tables = [pool.allocate(3)]
    for _ in range(3):
        tables.append(pool.allocate(3))
    for _ in range(5):
        for table in tables:
            table += pool.allocate(1, after=table[-1])
    assert all(len(runs(t, 4 * len(t), 4)) == 1 for t in tables)
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)


def test_placement_never_refuses_a_free_block():
    """Placement picks among free blocks; when the pool is tight it still uses them all."""
    pool = BlockPool(num_blocks=8, block=4)
    a, b = pool.allocate(3), pool.allocate(3)
    pool.release(a[1:2])                                  # holes: one block inside a, two at the end
    got = pool.allocate(3, after=b[-1])
    assert got is not None and sorted(got + a[:1] + a[2:] + b) == list(range(8))
    assert pool.allocate(1) is None and pool.available == 0


def _tiny_forward(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return BatchedForward(model, kv_blocks=64, block=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_do_not_depend_on_where_the_blocks_are(spiky_model_dir, dtype):
    """One sequence decoded through a consecutive table, a two-run table (a shared prefix, then its
    own blocks) and a scattered one (gathered): bit-for-bit the same logits at every step, and
    only the fragmented tables copy rows."""
    fw = _tiny_forward(spiky_model_dir, dtype)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(21)]
    steps = 12
    need = (len(prompt) + steps + 3) // 4
    scattered = random.Random(0).sample(range(40, 64), need)
    layouts = {"consecutive": list(range(need)), "two runs": [20, 21, 22] + list(range(30, 30 + need - 3)),
               "scattered": scattered}
    assert [len(runs(t, 4 * need, 4)) for t in layouts.values()][:2] == [1, 2]
    assert len(runs(scattered, 4 * need, 4)) > MAX_RUNS
    seen = {}
    for name, table in layouts.items():
        before = fw.stats["copied_rows"]
        logits = [fw.prefill([(prompt, 0, table)])]
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(logits[-1][0].argmax()))
            logits.append(fw.decode([tokens[-1]], [len(tokens) - 1], [table]))
        seen[name] = (torch.stack(logits), fw.stats["copied_rows"] - before)
    ref, copied = seen["consecutive"]
    assert copied == 0
    for name in ("two runs", "scattered"):
        assert torch.equal(seen[name][0], ref), name
        assert seen[name][1] > 0


def test_prefill_after_a_prefix_hit_reads_blocks_of_any_layout(spiky_model_dir):
    """The second half of a prompt prefilled over its first half's blocks gives the logits of
    the whole prompt at once, with its blocks consecutive or not."""
    fw = _tiny_forward(spiky_model_dir, torch.float32)
    prompt = [(5 * i + 1) % 200 + 5 for i in range(30)]
    whole = fw.prefill([(prompt, 0, list(range(8)))])
    for table in (list(range(8, 16)), [20, 21, 22, 23, 40, 41, 42, 43]):
        fw.prefill([(prompt[:16], 0, table)])
        torch.testing.assert_close(fw.prefill([(prompt, 16, table)]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_cached_positions_runs_the_fused_attention_kernel(spiky_model_dir, dtype):
    """An agent's every later turn is a prefill over its cached positions. Its mask must be one
    SDPA's fused kernel takes: a 3-D one sent each layer to the unfused path, which builds and
    softmaxes every [H, N, T] score (16 prefills of 800 tokens over 1,200 cached took 4x as long)."""
    fw = _tiny_forward(spiky_model_dir, dtype)
    prompt = [(5 * i + 1) % 200 + 5 for i in range(30)]
    fw.prefill([(prompt[:16], 0, list(range(8)))])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fw.prefill([(prompt, 16, list(range(8)))])
    ran = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
    assert "aten::_scaled_dot_product_attention_math" not in ran


def test_concurrent_decode_reads_the_cache_in_place(spiky_model_dir):
    """Eight requests decoding together, crossing block boundaries in turn: every block table
    stays one run, so no decode step copies keys, and each request gets its solo tokens."""
    text = "def parse(line):\n    return [int(x) for x in line.split(',')]\n" * 12
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8, prefix_cache_tokens=0) as engine:
        ids = engine.tokenizer.encode(text)
        prompts = [ids[i * 5: i * 5 + 40 + 9 * i] for i in range(8)]
        params = SamplingParams(max_tokens=70, temperature=0.0, stop_token_ids=NO_STOP)
        solo = [engine.generate(p, params).token_ids for p in prompts]
        engine._forward.stats["copied_rows"] = 0
        results = generate_concurrently(engine, prompts, [params] * len(prompts), timeout=300)
        assert results == solo
        assert engine.stats["max_batch_seen"] > 4
        assert engine._forward.stats["copied_rows"] == 0


def test_decode_steps_run_on_one_thread_and_leave_the_callers_alone(spiky_model_dir):
    """A decode step runs on `decode_threads` threads (on_token runs inside it); the prefill and
    the caller keep torch's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for decode_threads, want in ((1, 1), (None, 2)):
            seen: list[int] = []
            with LocalEngine(spiky_model_dir, dtype="float32", decode_threads=decode_threads) as engine:
                engine.generate(list(range(5, 30)), SamplingParams(max_tokens=6, temperature=0.0,
                                                                   stop_token_ids=NO_STOP),
                                on_token=lambda *_: seen.append(torch.get_num_threads()))
            assert seen == [2] + [want] * 5
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_concurrent_agents_attend_their_shared_prompt_once(spiky_model_dir):
    """Requests that begin with one long prompt (the prefix cache gives them its blocks) decode
    with that prompt attended once per step for all of them, and each gets its solo tokens."""
    text = "def parse(line):\n    return [int(x) for x in line.split(',')]\n" * 12
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as engine:
        ids = engine.tokenizer.encode(text)
        system = ids[: 32 * MIN_SHARED_BLOCKS + 20]
        prompts = [system + ids[7 * i: 7 * i + 5 + 3 * i] for i in range(6)]
        params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=NO_STOP)
        solo = [engine.generate(p, params).token_ids for p in prompts]
        engine._forward.stats["shared_rows"] = 0
        results = generate_concurrently(engine, prompts, [params] * len(prompts), timeout=300)
        assert results == solo
        assert engine._forward.stats["shared_rows"] >= 32 * MIN_SHARED_BLOCKS * 30
