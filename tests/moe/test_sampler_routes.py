"""Router replay's sampler side: the built-in engine records the experts of every position it feeds,
and a trajectory keeps them, compactly, through to the samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atelier.harness.trajectory import Segment, Trajectory
from atelier.inference.routes import decode_routes, encode_routes
from atelier.moe.replay import RouterReplay, unpack_routes
from atelier.rl.sample import samples_from_trajectory

NO = 255   # uint8's "no record"


@pytest.fixture(scope="module")
def moe_engine_and_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from atelier.inference.engine import LocalEngine
    from atelier.inference.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), moe=True, initializer_range=0.2)
    engine = LocalEngine(path, dtype="float32", max_batch=4, prefix_cache_tokens=4096)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield engine, model
    engine.close()


def test_engine_routes_replayed_reproduce_its_logprobs(moe_engine_and_model):
    """The engine's routes cover prompt and sampled tokens (the last one has no record); a
    full-sequence forward that replays them uses exactly those experts and reproduces the engine's
    logprobs within 1e-4 in fp32, for requests batched together and one that hits the prefix cache."""
    from atelier.inference.types import SamplingParams

    engine, model = moe_engine_and_model
    shared = list(range(40, 110))                       # 70 tokens: two full KV blocks to reuse
    prompts = [shared + [200 + i, 300 + i] for i in range(3)]
    handles = [engine.submit(p, SamplingParams(max_tokens=12, seed=i, stop_token_ids=(0,)))
               for i, p in enumerate(prompts)]
    gens = [h.result() for h in handles]
    hits = engine.stats["prefix_hit_tokens"]
    gens.append(engine.generate(prompts[0], SamplingParams(max_tokens=12, seed=7, stop_token_ids=(0,))))
    prompts.append(prompts[0])
    assert engine.stats["prefix_hit_tokens"] > hits          # the last request reused cached positions
    replay = RouterReplay(model)
    agree = rows = 0
    for prompt, gen in zip(prompts, gens):
        ids = prompt + gen.token_ids
        assert gen.routes.dtype == np.uint8 and gen.routes.shape == (len(ids), 2, 2)
        assert (gen.routes[-1] == NO).all() and (gen.routes[:-1] != NO).all()
        routes = unpack_routes(gen.routes)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
            free_used = replay.used()
            with replay.replay(routes):
                logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                used = replay.used()
        assert torch.equal(used[:-1], routes[:-1])              # exactly the sampler's experts
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        mu = torch.tensor(gen.logprobs)
        assert (logp[-len(mu):] - mu).abs().max() < 1e-4
        same = (free_used[:-1].sort(-1).values == routes[:-1].sort(-1).values).all(-1)
        agree, rows = agree + int(same.sum()), rows + same.numel()
    assert agree / rows > 0.95        # the records are the routers' real choices, not filler
    assert torch.equal(torch.from_numpy(gens[3].routes[:64].astype(np.int64)),
                       torch.from_numpy(gens[0].routes[:64].astype(np.int64)))   # cached rows come back


def _routes(rows: list[int]) -> np.ndarray:
    return np.array([[[r, r + 1 if r != NO else NO]] for r in rows], dtype=np.uint8)


def test_segment_routes_follow_the_tokens_and_the_first_record_wins():
    seg = Segment()
    seg.extend_prompt([1, 2, 3])
    seg.extend_sampled([4, 5], [-0.1, -0.2], [0, 0], _routes([0, 1, 2, 3, NO]))
    seg.extend_prompt([6, 7])                                  # tool output: not fed yet
    assert seg.routes.shape == (7, 1, 2) and (seg.routes[4:] == NO).all()
    # the next turn re-feeds everything; a recorded row that now differs keeps its first value
    seg.extend_sampled([8], [-0.3], [1], _routes([0, 1, 5, 3, 4, 5, 6, NO]))
    assert seg.routes[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, NO]
    with pytest.raises(ValueError, match="routes cover"):
        seg.extend_sampled([9], [-0.1], [1], _routes([0]))


def test_routes_persist_compactly_with_the_trajectory(tmp_path):
    seg = Segment()
    seg.extend_prompt([1, 2, 3])
    seg.extend_sampled([4, 5], [-0.1, -0.2], [0, 0], _routes([7, 1, 2, 3, NO]))
    traj = Trajectory(task_id="t", segments=[seg, Segment([1], [0], [0.0], [-1])])
    loaded = Trajectory.load(traj.save(tmp_path / "t.json"))
    assert np.array_equal(loaded.segments[0].routes, seg.routes) and loaded.segments[0].routes.dtype == np.uint8
    assert loaded.segments[1].routes is None
    encoded = encode_routes(seg.routes)
    assert len(json.dumps(encoded)) < 80 and np.array_equal(decode_routes(encoded), seg.routes)
    (sample,) = samples_from_trajectory(loaded, 1.0, "g")
    assert np.array_equal(sample.routes, seg.routes)


def test_generate_endpoint_carries_the_routes(moe_engine_and_model):
    """`atelier serve`'s /v1/generate returns the same routes the engine gives in process."""
    from atelier.inference.client import GenerateClient
    from atelier.inference.types import SamplingParams
    from tests.inference.conftest import serving

    engine, _ = moe_engine_and_model
    params = SamplingParams(max_tokens=6, seed=3, stop_token_ids=(0,))
    prompt = list(range(200, 240))
    local = engine.generate(prompt, params)
    with serving(engine) as url, GenerateClient(url) as client:
        remote = client.generate(prompt, params)
    assert remote.token_ids == local.token_ids
    assert remote.routes.dtype == np.uint8 and np.array_equal(remote.routes, local.routes)


def test_a_two_turn_segment_replays_to_both_turns_logprobs(moe_engine_and_model):
    """Turn 1, a tool output the sampler has not fed yet, turn 2 on the whole segment: the segment's
    routes then cover every token but the last, and one replayed forward over it reproduces the
    logprobs of both turns' sampled tokens within 1e-4 (fp32)."""
    from atelier.inference.types import SamplingParams

    engine, model = moe_engine_and_model
    seg = Segment()
    seg.extend_prompt(list(range(120, 170)))
    for turn in range(2):
        gen = engine.generate(list(seg.token_ids), SamplingParams(max_tokens=10, seed=20 + turn, stop_token_ids=(0,)))
        seg.extend_sampled(gen.token_ids, gen.logprobs, gen.versions, gen.routes)
        if turn == 0:
            seg.extend_prompt([9, 8, 7, 6, 5])                        # the tool's answer
            assert (seg.routes[-6:] == NO).all()
    assert (seg.routes[:-1] != NO).all() and (seg.routes[-1] == NO).all()
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replay(seg.routes):
        logits = model(input_ids=torch.tensor([seg.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seg.token_ids[1:])[:, None])[:, 0]
    sampled = torch.tensor(seg.loss_mask[1:]).bool()
    assert (logp[sampled] - torch.tensor(seg.logprobs[1:])[sampled]).abs().max() < 1e-4
