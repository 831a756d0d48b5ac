"""The engine's KV memory is its budget: blocks per sequence, waiting, preemption, cancellation."""

from __future__ import annotations

import threading

import pytest
import torch

from atelier.inference.engine import EngineBusy, LocalEngine, pick_dtype
from atelier.inference.forward import BatchedForward
from atelier.inference.types import SamplingParams
from atelier.train.devices import cpu_has_bf16

NO_STOP = (10**6,)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=NO_STOP)


def _mixed(engine: LocalEngine, count: int) -> list[tuple[list[int], int]]:
    """`count` (prompt, max_tokens) pairs of lengths from 3 to ~200 tokens, replies of 4 to 40."""
    text = "def parse(line):\n    return [int(x) for x in line.split(',')]\n" * 20
    ids = engine.tokenizer.encode(text)
    return [(ids[i % 7: i % 7 + 3 + (i * 37) % 200], 4 + (i * 13) % 37) for i in range(count)]


def test_32_concurrent_sequences_of_mixed_length_stay_within_the_kv_budget(spiky_model_dir):
    budget = 1024  # 32 blocks of 32; the 32 requests below need about 3,600 positions at once
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=32, kv_cache_tokens=budget) as engine:
        per_token = BatchedForward.kv_bytes_per_token(engine.model.config, torch.float32)
        assert engine.kv_bytes == budget * per_token  # allocated once, at the budget
        work = _mixed(engine, 32)
        assert sum(len(p) + n for p, n in work) > 3 * budget
        solo = [engine.generate(p, greedy(n)).token_ids for p, n in work]
        peak = [0]

        def watch(*_: object) -> None:  # runs on the scheduler thread, between steps' bookkeeping
            peak[0] = max(peak[0], engine.pool.used)

        results: list[list[int] | None] = [None] * len(work)
        barrier = threading.Barrier(len(work))

        def worker(i: int) -> None:
            barrier.wait()
            results[i] = engine.generate(work[i][0], greedy(work[i][1]), on_token=watch).token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert results == solo
        assert 0 < peak[0] <= engine.pool.num_blocks and engine.pool.peak_used <= engine.pool.num_blocks
        assert engine.stats["max_batch_seen"] > 1 and engine.stats["max_waiting"] > 0
        assert engine.pool.used == 0  # every block came back
        assert engine.kv_bytes == budget * per_token


def test_preempted_request_resumes_with_the_same_tokens(spiky_model_dir):
    """Two 40-token prompts fill a 4-block pool; growing past 64 positions preempts the younger,
    which later resumes from its own cached blocks and ends exactly as it would alone."""
    with LocalEngine(spiky_model_dir, dtype="float32", kv_cache_tokens=128) as engine:
        text = "import os\nimport sys\nfor name in os.listdir('.'):\n    print(name, file=sys.stderr)\n" * 4
        ids = engine.tokenizer.encode(text)
        prompts = [ids[:40], ids[3:43]]
        solo = [engine.generate(p, greedy(50)) for p in prompts]
        handles = [engine.submit(p, greedy(50)) for p in prompts]
        got = [h.result(timeout=300) for h in handles]
        assert engine.stats["preemptions"] >= 1
        assert engine.max_seq_len == 128
    for g, s in zip(got, solo):
        assert g.token_ids == s.token_ids
        assert g.logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_cancel_frees_blocks_of_running_and_waiting_requests(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=1) as engine:
        started, release = threading.Event(), threading.Event()

        def hold(*_: object) -> None:
            started.set()
            release.wait(60)

        running = engine.submit(engine.tokenizer.encode("def main():" * 20), greedy(400), on_token=hold)
        assert started.wait(60)
        waiting = engine.submit([1, 2, 3], greedy(5))   # no batch slot: waits
        assert engine.pool.used > 0 and engine.waiting == 1
        waiting.cancel()
        running.cancel()
        release.set()
        for handle in (running, waiting):
            assert handle.result(timeout=60).finish_reason == "abort"
        assert len(running.result().token_ids) < 400 and waiting.result().token_ids == []
        assert engine.pool.used == 0 and engine.stats["cancelled"] == 2
        assert engine.generate([1, 2, 3], greedy(3)).finish_reason == "length"  # still serving


def test_queue_limit_refuses_with_retry_after(spiky_model_dir):
    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=1, max_queue=1) as engine:
        started, release = threading.Event(), threading.Event()

        def hold(*_: object) -> None:
            started.set()
            release.wait(60)

        first = engine.submit([1, 2, 3], greedy(3), on_token=hold)
        assert started.wait(60)
        second = engine.submit([1, 2, 3], greedy(3))
        with pytest.raises(EngineBusy, match="waiting") as info:
            engine.submit([1, 2, 3], greedy(3))
        assert info.value.retry_after >= 1
        release.set()
        assert first.result(timeout=60).token_ids and second.result(timeout=60).token_ids


def test_bf16_is_the_default_where_the_cpu_has_it(spiky_model_dir):
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert pick_dtype("cpu", None) == want == pick_dtype("cpu", "auto")
    assert pick_dtype("cpu", "float32") == torch.float32  # overridable
    with LocalEngine(spiky_model_dir, max_batch=2, kv_cache_tokens=256) as engine:
        assert engine.dtype == want and engine._forward.kv.k_LHRD.dtype == want
