"""The decode step: the paged attention kernel against a plain reference, batched decode against
each sequence alone, block layouts, packed weights, the compiled and the eager paths, and the
choice of thread count."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from atelier.inference.attention import MAX_GROUPS, SHORT, decode_attention, decode_attention_eager, length_groups
from atelier.inference.engine import LocalEngine
from atelier.inference.forward import MAX_RUNS, BatchedForward, PackedLinear, can_pack, runs
from atelier.inference.prefix_cache import BlockPool
from atelier.inference.threads import PROBE_FIRST, SUSTAINED, StepThreads
from atelier.inference.types import SamplingParams
from tests.inference.conftest import generate_concurrently

NO_STOP = (10**6,)


def test_runs_merge_consecutive_blocks_and_cut_at_jumps():
    assert runs([4, 5, 6, 9, 10], 150, 32) == [(128, 96), (288, 54)]
    assert runs([7], 1, 32) == [(224, 1)]
    assert runs([3, 2], 64, 32) == [(96, 32), (64, 32)]     # descending ids are a jump too


def test_length_groups_bound_the_padding():
    assert length_groups([SHORT - 1, 3, 2]) == [(0, 3)]              # short: one call
    lengths = [4000, 3900, 3800, 1200, 1100, 300, 250, 40, 30, 20]
    groups = length_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths) and len(groups) <= MAX_GROUPS
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))      # contiguous slices, in order
    padded = sum((end - start) * lengths[start] for start, end in groups)
    assert padded < 1.5 * sum(lengths) < len(lengths) * lengths[0]
    assert length_groups([4000] * 8) == [(0, 8)]


def _reference_attention(q_BKGD, k_BKD, v_BKD, k_KRD, v_KRD, tables, lengths, block):
    """Each sequence on its own: its cached rows in order, then its new key, one softmax."""
    outs = []
    for b, (table, n) in enumerate(zip(tables, lengths)):
        rows = [table[p // block] * block + p % block for p in range(n)]
        k_KTD = torch.cat([k_KRD[:, rows], k_BKD[b][:, None]], dim=1).float()
        v_KTD = torch.cat([v_KRD[:, rows], v_BKD[b][:, None]], dim=1).float()
        weights = torch.softmax(q_BKGD[b].float() @ k_KTD.transpose(1, 2), dim=-1)
        outs.append(weights @ v_KTD)
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_attending_each_sequence_alone(dtype):
    """The fused form, its compiled kernel and the eager form against a per-sequence reference:
    tables of different widths and scattered blocks, lengths that end mid-block, padding blocks."""
    gen = torch.Generator().manual_seed(0)
    K, G, D, S, P = 2, 3, 16, 4, 64
    k_KRD, v_KRD = (torch.randn(K, P * S, D, generator=gen).to(dtype) for _ in range(2))
    lengths = [23, 17, 9, 1]
    tables = [random.Random(b).sample(range(1, P), (n + S - 1) // S) for b, n in enumerate(lengths)]
    width = max(len(t) for t in tables)
    tables_BN = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), K, G, D, generator=gen) * D ** -0.5
    k_BKD, v_BKD = (torch.randn(len(lengths), K, D, generator=gen).to(dtype) for _ in range(2))
    args = (q, k_BKD, v_BKD, k_KRD, v_KRD, tables_BN, torch.tensor(lengths), S)
    want = _reference_attention(q, k_BKD, v_BKD, k_KRD, v_KRD, tables, lengths, S)
    for got in (decode_attention(*args), decode_attention_eager(*args), torch.compile(decode_attention)(*args)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


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


def _tiny_forward(model_dir, dtype, compile=None, blocks=64, block=4):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return BatchedForward(model, kv_blocks=blocks, block=block, compile=compile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_do_not_depend_on_where_the_blocks_are(spiky_model_dir, dtype):
    """One sequence decoded through a consecutive table, a two-run table (a shared prefix, then its
    own blocks) and a scattered one: bit-for-bit the same logits at every step."""
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
        logits = [fw.prefill([(prompt, 0, table)])]
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(logits[-1][0].argmax()))
            logits.append(fw.decode([tokens[-1]], [len(tokens) - 1], [table]))
        seen[name] = torch.stack(logits)
    for name in ("two runs", "scattered"):
        assert torch.equal(seen[name], seen["consecutive"]), name


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


@pytest.mark.parametrize("compile", [True, False])
def test_a_batch_of_very_different_lengths_decodes_as_each_alone(spiky_model_dir, compile):
    """Sequences from 6 to ~700 positions in one decode batch (so it is cut into several length
    groups, and runs in an order that is not the caller's): each row's logits are those the
    sequence gets alone, and the greedy tokens are the same."""
    fw = _tiny_forward(spiky_model_dir, torch.float32, compile=compile, blocks=512, block=8)
    lengths = [40, 700, 6, 300, 650, 120]
    prompts = [[(11 * i + 7 * b) % 200 + 5 for i in range(n)] for b, n in enumerate(lengths)]
    tables, at = [], 0
    for n in lengths:
        tables.append(list(range(at, at + (n + 8 + 7) // 8 + 1)))
        at += len(tables[-1])
    alone = []
    for p, table in zip(prompts, tables):
        fw.prefill([(p, 0, table)])
        alone.append([fw.decode([p[-1]], [len(p) - 1], [table])[0]])
    groups_before = fw.stats["decode_groups"]
    together = fw.decode([p[-1] for p in prompts], [len(p) - 1 for p in prompts], tables)
    assert fw.stats["decode_groups"] - groups_before > 1
    for b in range(len(lengths)):
        torch.testing.assert_close(together[b], alone[b][0], atol=1e-4, rtol=1e-4)
    assert together.argmax(-1).tolist() == [int(a[0].argmax()) for a in alone]


def test_compiled_and_eager_decode_give_the_same_tokens(spiky_model_dir):
    """The same requests through an engine whose decode is compiled and one that runs eagerly:
    identical greedy tokens, and logprobs equal to rounding."""
    prompts = [[(13 * i + 5 * b) % 200 + 5 for i in range(9 + 23 * b)] for b in range(5)]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=NO_STOP)
    seen = {}
    for compile in (True, False):
        with LocalEngine(spiky_model_dir, dtype="float32", compile=compile) as engine:
            assert engine._forward.attention.compiled is compile
            seen[compile] = [engine.generate(p, params) for p in prompts]
            seen[compile] += generate_concurrently(engine, prompts, [params] * len(prompts), timeout=300)
    for compiled, eager in zip(seen[True], seen[False]):
        if isinstance(compiled, list):
            assert compiled == eager
            continue
        assert compiled.token_ids == eager.token_ids
        torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), atol=1e-5, rtol=0)


@pytest.mark.skipif(not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="this CPU has no bf16 oneDNN")
def test_packed_weights_compute_what_f_linear_does_and_follow_updates():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(weight, bias)
    assert linear.packed is not None and linear.nbytes == weight.numel() * 2
    for rows in (1, 5, 300):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, weight, bias))
    packed = linear.packed
    with torch.no_grad():
        weight.mul_(-2)
    linear.refresh()
    assert linear.packed is packed     # re-laid in place: a compiled step keeps its input
    assert torch.equal(linear(x), F.linear(x, weight, bias))


def test_fixed_threads_run_every_step_and_leave_the_callers_alone(spiky_model_dir):
    """An engine pinned to one thread runs every step on it (on_token runs inside the step); the
    caller's thread count is its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        with LocalEngine(spiky_model_dir, dtype="float32", threads=1) as engine:
            engine.generate(list(range(5, 30)), SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=NO_STOP),
                            on_token=lambda *_: seen.append(torch.get_num_threads()))
        assert seen == [1] * 6
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_step_threads_probe_the_other_count_and_keep_the_faster(monkeypatch):
    """Now and then a decode step runs on the other thread count; it becomes the count when it
    was clearly faster than the steps before it, else the next probe waits twice as long."""
    clock = [1000.0]
    monkeypatch.setattr("atelier.inference.threads.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("atelier.inference.threads.run_queue_wait_ns", lambda tid: 0)
    policy = StepThreads(most=2)

    def step(batch: int, seconds: dict[int, float]) -> int:
        n = policy.choose(batch)
        policy.record(n, batch, seconds[n])
        clock[0] += 0.1
        return n

    quiet = {2: 0.010, 1: 0.016}
    assert [step(8, quiet) for _ in range(5)] == [2] * 5
    clock[0] += PROBE_FIRST
    assert step(8, quiet) == 1                       # a probe, slower: 2 stays
    assert [step(8, quiet) for _ in range(5)] == [2] * 5
    assert policy.current == 2 and policy._probe_gap[policy.bucket(8)] == 2 * PROBE_FIRST
    busy = {2: 0.050, 1: 0.020}                      # e.g. another OpenMP team in the process
    assert [step(8, busy) for _ in range(4)] == [2] * 4
    clock[0] += 2 * PROBE_FIRST
    assert [step(8, busy) for _ in range(3)] == [1, 1, 1]
    assert policy.current == 1 and policy.switches == 1
    assert StepThreads(fixed=1).choose(8) == 1 and StepThreads(most=1).choose(8) == 1


def test_step_threads_choose_for_each_batch_size_apart(monkeypatch):
    """One thread can be the faster for a batch of one while two are for a batch of 64 (small
    operations wait for both threads, large ones gain): each size keeps its own count."""
    clock = [1000.0]
    monkeypatch.setattr("atelier.inference.threads.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("atelier.inference.threads.run_queue_wait_ns", lambda tid: 0)
    policy = StepThreads(most=2)
    seconds = {(1, 2): 0.020, (1, 1): 0.012, (64, 2): 0.050, (64, 1): 0.090}

    def step(batch: int) -> int:
        n = policy.choose(batch)
        policy.record(n, batch, seconds[(batch, n)])
        clock[0] += 0.1
        return n

    for _ in range(3):
        step(1), step(64)
    clock[0] += PROBE_FIRST
    step(1), step(64)                                  # each size probes its other count
    assert [step(1) for _ in range(3)] == [1, 1, 1]
    assert [step(64) for _ in range(3)] == [2, 2, 2]


def test_step_threads_drop_to_one_when_the_cores_are_wanted(monkeypatch):
    """Waiting for a core more than a tenth of the time (run-queue delay), window after window,
    means one thread; one contended window among quiet ones does not."""
    clock, waited = [1000.0], [0]
    monkeypatch.setattr("atelier.inference.threads.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("atelier.inference.threads.run_queue_wait_ns", lambda tid: waited[0])
    policy = StepThreads(most=2)
    assert policy.choose(4) == 2
    clock[0] += 1.0
    waited[0] += int(0.05e9)                          # 5% of a second: fine
    assert policy.choose(4) == 2
    clock[0] += 1.0
    waited[0] += int(0.3e9)                           # one burst: still two
    assert policy.choose(4) == 2
    clock[0] += 1.0
    assert policy.choose(4) == 2
    for _ in range(SUSTAINED - 1):
        clock[0] += 1.0
        waited[0] += int(0.3e9)
        assert policy.choose(4) == 2
    clock[0] += 1.0
    waited[0] += int(0.3e9)
    assert policy.choose(4) == 1


def test_a_compiled_region_keeps_its_room_for_graphs_on_any_thread() -> None:
    """Dynamo's settings hold only for the thread that makes them, and every engine runs on a
    thread of its own: the decode layer's room for graphs goes with its compiled region, so a
    thread that never touched the settings still compiles past dynamo's default of 8."""
    import threading

    from atelier.inference.forward import RECOMPILE_LIMIT, compile_for_every_shape

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(example_inputs[0].shape[0])
        return gm.forward

    compiled = compile_for_every_shape(lambda x: x * 2, dynamic=False, backend=counting)
    sizes = list(range(1, 13))
    assert 8 < len(sizes) < RECOMPILE_LIMIT
    worker = threading.Thread(target=lambda: [compiled(torch.ones(n)) for n in sizes])
    worker.start()
    worker.join()
    assert graphs == sizes   # past the limit the rest would run uncompiled, with no graph
